"""The fp8 GEMMs on Hopper. The row GEMM: C[rows] = A[rows] · B[e]ᵀ on e4m3 operands with DeepSeek-V3's scales (one fp32
per 1 x 128 group of A's rows, per 128 x 128 block of B), A's rows gathered through the token ids by cp.async (x
and dy, quantized once per token: their scales follow the gather), A in place read by TMA (tma_a; 1-11% faster
than the gathering loader over the identity at B, D and E, which tma_a=False still runs). B is (E·N, K), K-major,
as fp8 wgmma needs both operands.

Partitions: the gathering loader (a whole warpgroup; or a 1-warp TMA loader) and the MMA warps, which store their
own tiles. A tile is 128 x 256: two 128-column halves (one weight block each) that share each stage's A, so a
gathered row of A feeds twice the columns of a 128 x 128 tile. Per 128-deep stage, each half's MMAs run from zero
and their fp32 result is scaled and added to the half's accumulator (the promotion every 128 of K that Hopper's
narrower fp8 accumulation needs), waited for before the next MMAs: two accumulators and one partial are what the
registers hold. With a 16-bit C the MMA warps are two partitions of one warpgroup, each on its own 64 rows of the
tile (split): each releases a stage and stores its rows on its own, and the second starts once the first has
issued its first MMAs, so that one's promotions run beside the other's MMAs. As one 8-warp partition (split=False,
and fp32 C, which spills split) the two warpgroups issued, waited and promoted in step, and an ncu profile at D
had the tensor pipe active 48-61% of cycles; split runs the four GEMMs of B, D and E in 0.72-0.87x the time
(docs/notes/). Each partition stores through two staging buffers, so that a tile's second half does not
wait for the first half's store, and loads the next tile's schedule entry and token ids as a tile begins (a
tile's first promotion then waits for one load of its A scales, not for the chain schedule -> token ids ->
scales).

Registers: 64 for the loader, 216 for the second MMA warpgroup (setmaxnreg; the first takes the rest); no
variant with a 16-bit C spills on triton 3.6; on 3.9 the bf16 row GEMMs keep 8 bytes of stack a thread (ptxas).

Memory contract: nothing beyond C. Shared memory: STAGES x (128 + 256) x 128 bytes of operands and
64 KB of C staging (four 64 x 128 bf16 tiles, or one 128 x 128 fp32 tile).
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ...launch import launch, sm_count
from ...reference.fp8 import GROUP
from ..schedule import BLOCK_M
from .common import (GATHER_WARPS, descriptor, mma_layout, my_tiles, one_barrier, stage_barriers, store_ring,
                     tile_of)
from .partitions import gather_loader, tma_loader

FP8_BLOCK_N = 2 * GROUP  # a tile's columns: two weight blocks, each half's weight scale one number a stage
FP8_STAGES = 3
FP8_WORKER_REGS = 64  # the loader's registers: the fewest at which the bf16 gathering kernel spills nothing
FP8_MMA_REGS = 216  # split: the second MMA warpgroup's registers (at 224 the first spills)
SCALE_BLOCK = gl.constexpr(GROUP)  # the columns (and K) of one weight scale


@gluon.jit
def tile_tokens(j, pid, nprog, n_used, n_tn, offs_m, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr,
                expert_offsets_ptr):
    """This program's j-th tile (tile_of) and the token ids of its rows, where their A scales are: (expert,
    first row, row end, column tile, token ids); offs_m: the rows' offsets in the accumulator's row layout."""
    e, row0, row_end, pid_n = tile_of(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr)
    rows = row0 + offs_m
    return e, row0, row_end, pid_n, gl.load(token_ptr + rows, mask=rows < n_rows, other=0)


@gluon.jit
def half_mma(a, b, h: gl.constexpr, acc_layout: gl.constexpr):
    """The MMAs of a stage's half h (B's rows h · HALF on) from zero, issued and in flight: a 128-deep stage's
    partial, promoted by the caller once waited for."""
    BLOCK_M: gl.constexpr = a.type.shape[0]
    BLOCK_K: gl.constexpr = a.type.shape[1]
    HALF: gl.constexpr = b.type.shape[0] // 2
    return warpgroup_mma(a, b.slice(h * HALF, HALF, dim=0).permute((1, 0)),
                         gl.zeros([BLOCK_M, HALF], gl.float32, acc_layout), use_acc=False,
                         max_num_imprecise_acc=BLOCK_K, is_async=True)


@gluon.jit
def fp8_mma_store(c_bufs, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, go, sa_ptr, stride_sal, sb_ptr,
                  stride_sbe, stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                  used_tiles_ptr, N, K_DIM, WG: gl.constexpr, N_WG: gl.constexpr):
    """Every tile of this program, as two 128-column halves sharing each stage's A: per stage, a half's MMAs
    from zero, waited for and scaled into its accumulator (acc += part · s_a · s_b), then the other half's; then
    both halves stored by these warps through the ring c_bufs (store_ring; a second half past N is skipped).
    The next tile's schedule entry and token ids (where its A scales are) are loaded as a tile begins, so that a
    tile's first promotion waits for one load of its scales, not for the chain schedule -> tokens -> scales.
    N_WG partitions share each tile, WG taking its BLOCK_M / N_WG rows: with two, each warpgroup runs on its own
    (its own stores, its own release of a stage), and warpgroup 1 starts once warpgroup 0 has issued its first
    MMAs, so that one's promotions run beside the other's MMAs instead of in step with them."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    HALF: gl.constexpr = BLOCK_N // 2
    ROWS: gl.constexpr = BLOCK_M // N_WG
    acc_layout: gl.constexpr = mma_layout(gl.num_warps(), HALF, 32)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    n_tn = gl.cdiv(N, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    pid, nprog, n_used, n_mine = my_tiles(used_tiles_ptr, n_tn)
    offs_m = WG * ROWS + gl.arange(0, ROWS, layout=row_layout)
    if n_mine > 0:
        walk = (pid, nprog, n_used, n_tn, offs_m, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr)
        e1, row1, end1, pid_n1, src1 = tile_tokens(0, *walk)
        n_st = 0
        if WG == 1:
            mbarrier.wait(go.index(0), 0)
        for j in range(n_mine):
            e, row0, row_end, pid_n, src = e1, row1, end1, pid_n1, src1
            # the last tile's entry again past the end: loaded, never used
            e1, row1, end1, pid_n1, src1 = tile_tokens(gl.minimum(j + 1, n_mine - 1), *walk)
            rmask = row0 + offs_m < row_end
            sa_ptrs = sa_ptr + src.to(gl.int64) * stride_sal
            sb0 = sb_ptr + e.to(gl.int64) * stride_sbe + pid_n * (BLOCK_N // SCALE_BLOCK) * stride_sbn
            has1 = pid_n * BLOCK_N + HALF < N  # past N, the second half's B rows are the next expert's (or zeros)
            acc0 = gl.zeros([ROWS, HALF], gl.float32, acc_layout)
            acc1 = gl.zeros([ROWS, HALF], gl.float32, acc_layout)
            for k in range(n_k):
                c = j * n_k + k
                s = c % S
                mbarrier.wait(ready.index(s), (c // S) & 1)
                fence_async_shared()  # A came by cp.async (generic proxy); wgmma reads through the async proxy
                a = a_bufs.index(s)
                if N_WG > 1:
                    a = a.slice(WG * ROWS, ROWS, dim=0)
                b = b_bufs.index(s)
                part = half_mma(a, b, 0, acc_layout)
                if N_WG > 1 and WG == 0:
                    mbarrier.arrive(go.index(0), pred=c == 0)
                sa = gl.load(sa_ptrs + k, mask=rmask, other=0.0)  # loaded while the MMAs run
                s0 = gl.load(sb0 + k)
                s1 = gl.load(sb0 + stride_sbn + k, mask=has1, other=0.0)
                part = warpgroup_mma_wait(0, deps=(part, ))
                acc0 += part * (sa * s0)[:, None]
                part = warpgroup_mma_wait(0, deps=(half_mma(a, b, 1, acc_layout), ))
                mbarrier.arrive(empty.index(s))  # both halves have read the stage
                acc1 += part * (sa * s1)[:, None]
            first = row0 + WG * ROWS
            n_st = store_ring(acc0, c_bufs, n_st, c_desc, c_ptr, stride_cl, first, row_end, pid_n * BLOCK_N, N)
            if has1:
                n_st = store_ring(acc1, c_bufs, n_st, c_desc, c_ptr, stride_cl, first, row_end,
                                  pid_n * BLOCK_N + HALF, N)
    tma.store_wait(0)


# gl.warp_specialize passes a partition runtime arguments only: each partition's constexprs (its warpgroup, how
# many there are) are bound by a function of its own
@gluon.jit
def fp8_wg0(c_bufs, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, go, sa_ptr, stride_sal, sb_ptr, stride_sbe,
            stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, N,
            K_DIM):
    fp8_mma_store(c_bufs, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, go, sa_ptr, stride_sal, sb_ptr,
                  stride_sbe, stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                  used_tiles_ptr, N, K_DIM, 0, 2)


@gluon.jit
def fp8_wg1(c_bufs, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, go, sa_ptr, stride_sal, sb_ptr, stride_sbe,
            stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, N,
            K_DIM):
    fp8_mma_store(c_bufs, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, go, sa_ptr, stride_sal, sb_ptr,
                  stride_sbe, stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                  used_tiles_ptr, N, K_DIM, 1, 2)


@gluon.jit
def fp8_one(c_bufs, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, go, sa_ptr, stride_sal, sb_ptr, stride_sbe,
            stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, N,
            K_DIM):
    fp8_mma_store(c_bufs, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, go, sa_ptr, stride_sal, sb_ptr,
                  stride_sbe, stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                  used_tiles_ptr, N, K_DIM, 0, 1)


@gluon.jit
def fp8_rows_kernel(x_ptr, stride_xl, token_ptr, n_rows, b_desc, c_desc, c_ptr, stride_cl, sa_ptr, stride_sal, sb_ptr,
                    stride_sbe, stride_sbn, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, expert_offsets_ptr, N, K_DIM,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                    WORKER_REGS: gl.constexpr, STORE_BUFS: gl.constexpr, N_WG: gl.constexpr, MMA_REGS: gl.constexpr):
    """C[rows] = x[token[rows]] · B[e]ᵀ on e4m3: MMA warps that promote and store (8 warps, or two warpgroups of
    4: N_WG), behind a gathering loader of a whole warpgroup."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], b_desc.dtype)
    a_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready, empty = stage_barriers(STAGES, 32 * GATHER_WARPS + 1, N_WG)
    go = one_barrier()
    c0 = gl.allocate_shared_memory(c_desc.dtype, [STORE_BUFS, BLOCK_M // N_WG, BLOCK_N // 2], c_desc.layout)
    rest = (c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, go, sa_ptr, stride_sal, sb_ptr, stride_sbe,
            stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, N, K_DIM)
    loader_args = (x_ptr, stride_xl, token_ptr, n_rows, b_desc, b_desc, a_bufs, b_bufs, ready, empty,
                   tile_expert_ptr, tile_row_ptr, used_tiles_ptr, N, K_DIM, False)
    if N_WG == 1:
        gl.warp_specialize([(fp8_one, (c0, ) + rest), (gather_loader, loader_args)], [GATHER_WARPS], [WORKER_REGS])
    else:
        c1 = gl.allocate_shared_memory(c_desc.dtype, [STORE_BUFS, BLOCK_M // N_WG, BLOCK_N // 2], c_desc.layout)
        gl.warp_specialize([(fp8_wg0, (c0, ) + rest), (fp8_wg1, (c1, ) + rest), (gather_loader, loader_args)],
                           [4, GATHER_WARPS], [MMA_REGS, WORKER_REGS])


@gluon.jit
def fp8_rows_tma_kernel(a_desc, token_ptr, n_rows, b_desc, c_desc, c_ptr, stride_cl, sa_ptr, stride_sal, sb_ptr,
                        stride_sbe, stride_sbn, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, expert_offsets_ptr, N,
                        K_DIM, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                        STAGES: gl.constexpr, WORKER_REGS: gl.constexpr, STORE_BUFS: gl.constexpr,
                        N_WG: gl.constexpr, MMA_REGS: gl.constexpr):
    """C[rows] = A[rows] · B[e]ᵀ on e4m3, A in place: the same MMA warps behind a 1-warp TMA loader (token: the
    identity, through which the MMA warps read A's scales)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready, empty = stage_barriers(STAGES, 1, N_WG)
    go = one_barrier()
    c0 = gl.allocate_shared_memory(c_desc.dtype, [STORE_BUFS, BLOCK_M // N_WG, BLOCK_N // 2], c_desc.layout)
    rest = (c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, go, sa_ptr, stride_sal, sb_ptr, stride_sbe,
            stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, N, K_DIM)
    loader_args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, N,
                   K_DIM)
    if N_WG == 1:
        gl.warp_specialize([(fp8_one, (c0, ) + rest), (tma_loader, loader_args)], [1], [WORKER_REGS])
    else:
        c1 = gl.allocate_shared_memory(c_desc.dtype, [STORE_BUFS, BLOCK_M // N_WG, BLOCK_N // 2], c_desc.layout)
        gl.warp_specialize([(fp8_wg0, (c0, ) + rest), (fp8_wg1, (c1, ) + rest), (tma_loader, loader_args)],
                           [4, 1], [MMA_REGS, WORKER_REGS])


def fp8_rows_gemm(a_q, a_scale, b_q, b_scale, num_rows, offsets, sched, token=None, *, out_dtype=None, out=None,
                  tma_a: bool = True):
    """experts.tl.fp8.fp8_rows_gemm on Hopper (same arguments and result): a_q (·, K) e4m3 contiguous with
    a_scale (·, ceil(K / 128)) fp32, b_q (E, N, K) e4m3 contiguous with b_scale (E, ceil(N / 128), ceil(K / 128));
    K a multiple of 128, N of 8. A in place (token None) is read by TMA (tma_a), or through the gathering loader
    with the identity as tokens. C is staged through two buffers for a 16-bit C (whose two 32 KB buffers fit
    beside the stages), one for fp32; the MMA warps are two warpgroups each on its own for a 16-bit C (an fp32 C's
    accumulators and stores spill that way), the second with FP8_MMA_REGS registers, the first the rest.
    The dispatcher (experts.dispatch) checks these; the launcher does not."""
    E, N, K = b_q.shape
    c = a_q.new_empty(num_rows, N, dtype=out_dtype) if out is None else out
    in_place = token is None
    if in_place:
        token = torch.arange(num_rows, dtype=torch.int32, device=a_q.device)
    split = c.element_size() == 2
    n_wg = 2 if split else 1
    # what both kernels take after A: B, C, the scales, the schedule, the sizes
    rest = (descriptor(b_q.reshape(E * N, K), [FP8_BLOCK_N, GROUP]), descriptor(c, [BLOCK_M // n_wg, GROUP]), c,
            c.stride(0), a_scale, a_scale.stride(0), b_scale, b_scale.stride(0), b_scale.stride(1), sched[0],
            sched[1], sched[2], offsets, N, K)
    meta = dict(BLOCK_M=BLOCK_M, BLOCK_N=FP8_BLOCK_N, BLOCK_K=GROUP, STAGES=FP8_STAGES, WORKER_REGS=FP8_WORKER_REGS,
                STORE_BUFS=2 if split else 1, N_WG=n_wg, MMA_REGS=FP8_MMA_REGS, num_warps=8 // n_wg, maxnreg=168)
    if in_place and tma_a:
        launch(fp8_rows_tma_kernel, (sm_count(a_q.device),), descriptor(a_q, [BLOCK_M, GROUP]), token, num_rows,
               *rest, **meta)
    else:
        launch(fp8_rows_kernel, (sm_count(a_q.device),), a_q, a_q.stride(0), token, token.shape[0], *rest, **meta)
    return c

