"""The fp8 row GEMM on Hopper: C[rows] = A[rows] · B[e]ᵀ on e4m3 operands with DeepSeek-V3's scales (one fp32
per 1 x 128 group of A's rows, per 128 x 128 block of B), A's rows gathered through the token ids by cp.async (x
and dy, quantized once per token: their scales follow the gather; A in place through the identity, or, with
tma_a, read in place by TMA: an experiment to time against the gathering loader before it becomes the default).
B is (E·N, K), K-major, as fp8 wgmma needs both operands.

Partitions: the gathering loader (a whole warpgroup; or a 1-warp TMA loader) and 8 MMA warps (two warpgroups of 64
rows)
that store their own 128 x 128 tiles. Each 128-deep stage is one MMA group from zero whose fp32 result is scaled
and added to the tile's accumulator (the promotion every 128 of K that Hopper's narrower fp8 accumulation needs);
the next stage's MMAs are issued before this stage's are scaled, so the tensor cores work through the promotion
(two partial accumulators in flight, and the other warpgroup's MMAs besides). The scales are loaded by the MMA
warps themselves when a stage's MMAs are issued, and used once they are done.

Memory contract: nothing beyond C. Shared memory: STAGES x (128 + 128) x 128 bytes of operands and one 128 x 128
tile of C in its dtype.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ...launch import launch, sm_count
from ...reference.fp8 import GROUP
from ..schedule import BLOCK_M
from .common import GATHER_WARPS, descriptor, mma_layout, my_tiles, stage_barriers, store_tile, tile_of
from .partitions import gather_loader, tma_loader

FP8_BLOCK_N = 128  # one weight block's columns: a stage's weight scale is one number
FP8_STAGES = 4
SCALE_BLOCK = gl.constexpr(GROUP)  # the columns (and K) of one weight scale


@gluon.jit
def _scales(sa_ptrs, sb_ptr, rmask, kb):
    """The scale of each of the tile's rows for K-block kb: A's (per row) times B's (one per block)."""
    return gl.load(sa_ptrs + kb, mask=rmask, other=0.0) * gl.load(sb_ptr + kb)


@gluon.jit
def scaled_tile(j, pid, nprog, n_used, n_tn, offs_m, token_ptr, n_rows, sa_ptr, stride_sal, sb_ptr, stride_sbe,
                stride_sbn, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, BLOCK_N: gl.constexpr):
    """This program's j-th tile (tile_of) with where its scales are: (first row, row end, column tile, its rows'
    mask, A's scale pointers of its rows (through the token ids), B's of its first weight block); offs_m: the
    rows' offsets in the accumulator's row layout."""
    e, row0, row_end, pid_n = tile_of(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr)
    rows = row0 + offs_m
    src = gl.load(token_ptr + rows, mask=rows < n_rows, other=0)
    sb_tile = sb_ptr + e.to(gl.int64) * stride_sbe + pid_n * (BLOCK_N // SCALE_BLOCK) * stride_sbn
    return row0, row_end, pid_n, rows < row_end, sa_ptr + src.to(gl.int64) * stride_sal, sb_tile


@gluon.jit
def fp8_mma_store(c_smem, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, sa_ptr, stride_sal, sb_ptr,
                  stride_sbe, stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                  used_tiles_ptr, N, K_DIM):
    """Every tile of this program: per stage, part = A_s · B_sᵀ from zero, acc += part · s_a · s_b (stage k's MMAs
    issued before stage k-1's result is scaled); then the tile stored by these warps (store_tile)."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    acc_layout: gl.constexpr = mma_layout(8, BLOCK_N, 32)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    n_tn = gl.cdiv(N, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    pid, nprog, n_used, n_mine = my_tiles(used_tiles_ptr, n_tn)
    offs_m = gl.arange(0, BLOCK_M, layout=row_layout)
    for j in range(n_mine):
        row0, row_end, pid_n, rmask, sa_ptrs, sb_tile = scaled_tile(
            j, pid, nprog, n_used, n_tn, offs_m, token_ptr, n_rows, sa_ptr, stride_sal, sb_ptr, stride_sbe,
            stride_sbn, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, BLOCK_N)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        c0 = j * n_k
        # stage 0's MMAs, then each next stage's issued before the previous one's result is scaled
        mbarrier.wait(ready.index(c0 % S), (c0 // S) & 1)
        fence_async_shared()  # A came by cp.async (generic proxy); wgmma reads through the async proxy
        prev = warpgroup_mma(a_bufs.index(c0 % S), b_bufs.index(c0 % S).permute((1, 0)),
                             gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout), use_acc=False,
                             max_num_imprecise_acc=BLOCK_K, is_async=True)
        scale_prev = _scales(sa_ptrs, sb_tile, rmask, 0)  # loaded while the MMAs run, used a stage later
        for k in range(1, n_k):
            c = c0 + k
            s = c % S
            mbarrier.wait(ready.index(s), (c // S) & 1)
            fence_async_shared()
            cur = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)),
                                gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout), use_acc=False,
                                max_num_imprecise_acc=BLOCK_K, is_async=True)
            scale_cur = _scales(sa_ptrs, sb_tile, rmask, k)
            prev = warpgroup_mma_wait(1, deps=(prev, ))  # stage k-1's MMAs are done: its stage goes back
            mbarrier.arrive(empty.index((c - 1) % S))
            acc += prev * scale_prev[:, None]
            prev, scale_prev = cur, scale_cur
        prev = warpgroup_mma_wait(0, deps=(prev, ))
        mbarrier.arrive(empty.index((c0 + n_k - 1) % S))
        acc += prev * scale_prev[:, None]
        store_tile(acc, c_smem, c_desc, c_ptr, stride_cl, row0, row_end, pid_n * BLOCK_N, N)
    tma.store_wait(0)


@gluon.jit
def fp8_rows_kernel(x_ptr, stride_xl, token_ptr, n_rows, b_desc, c_desc, c_ptr, stride_cl, sa_ptr, stride_sal, sb_ptr,
                    stride_sbe, stride_sbn, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, expert_offsets_ptr, N, K_DIM,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                    WORKER_REGS: gl.constexpr):
    """C[rows] = x[token[rows]] · B[e]ᵀ on e4m3: 8 MMA warps that promote and store, behind a gathering loader of a
    whole warpgroup."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], b_desc.dtype)
    a_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    ready, empty = stage_barriers(STAGES, 32 * GATHER_WARPS + 1)
    mma_args = (c_smem, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, sa_ptr, stride_sal, sb_ptr, stride_sbe,
                stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, N,
                K_DIM)
    loader_args = (x_ptr, stride_xl, token_ptr, n_rows, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr,
                   tile_row_ptr, used_tiles_ptr, N, K_DIM)
    gl.warp_specialize([(fp8_mma_store, mma_args), (gather_loader, loader_args)], [GATHER_WARPS], [WORKER_REGS])


@gluon.jit
def fp8_rows_tma_kernel(a_desc, token_ptr, n_rows, b_desc, c_desc, c_ptr, stride_cl, sa_ptr, stride_sal, sb_ptr,
                        stride_sbe, stride_sbn, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, expert_offsets_ptr, N,
                        K_DIM, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                        STAGES: gl.constexpr, WORKER_REGS: gl.constexpr):
    """C[rows] = A[rows] · B[e]ᵀ on e4m3, A in place: the same 8 MMA warps behind a 1-warp TMA loader (token: the
    identity, through which the MMA warps read A's scales)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    ready, empty = stage_barriers(STAGES, 1)
    mma_args = (c_smem, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, sa_ptr, stride_sal, sb_ptr, stride_sbe,
                stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, N,
                K_DIM)
    loader_args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, N,
                   K_DIM)
    gl.warp_specialize([(fp8_mma_store, mma_args), (tma_loader, loader_args)], [1], [WORKER_REGS])


def fp8_rows_gemm(a_q, a_scale, b_q, b_scale, num_rows, offsets, sched, token=None, out_dtype=None, out=None,
                  stages: int = FP8_STAGES, worker_regs: int = 56, tma_a: bool = False):
    """experts.tl.fp8.fp8_rows_gemm on Hopper (same arguments and result): a_q (·, K) e4m3 contiguous with
    a_scale (·, ceil(K / 128)) fp32, b_q (E, N, K) e4m3 contiguous with b_scale (E, ceil(N / 128), ceil(K / 128));
    K a multiple of 128, N of 8. A in place (token None) is read through the gathering loader with the identity as
    tokens, or by TMA where tma_a (not yet the default: to be timed against it on the GPU). The dispatcher
    (experts.dispatch) checks these; the launcher does not."""
    E, N, K = b_q.shape
    c = a_q.new_empty(num_rows, N, dtype=out_dtype) if out is None else out
    in_place = token is None
    if in_place:
        token = torch.arange(num_rows, dtype=torch.int32, device=a_q.device)
    # what both kernels take after A: B, C, the scales, the schedule, the sizes
    rest = (descriptor(b_q.reshape(E * N, K), [FP8_BLOCK_N, GROUP]), descriptor(c, [BLOCK_M, FP8_BLOCK_N]), c,
            c.stride(0), a_scale, a_scale.stride(0), b_scale, b_scale.stride(0), b_scale.stride(1), sched[0],
            sched[1], sched[2], offsets, N, K)
    meta = dict(BLOCK_M=BLOCK_M, BLOCK_N=FP8_BLOCK_N, BLOCK_K=GROUP, STAGES=stages, WORKER_REGS=worker_regs,
                num_warps=8, maxnreg=168)
    if in_place and tma_a:
        launch(fp8_rows_tma_kernel, (sm_count(a_q.device),), descriptor(a_q, [BLOCK_M, GROUP]), token, num_rows,
               *rest, **meta)
    else:
        launch(fp8_rows_kernel, (sm_count(a_q.device),), a_q, a_q.stride(0), token, token.shape[0], *rest, **meta)
    return c
