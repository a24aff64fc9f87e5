"""Prototype, Hopper only (sm_90), not wired into the library: the row GEMM C[rows] = A[rows] @ B[e]ᵀ
(down-projection: A = activated rows, B = W2 as (E·N, K)) as a Gluon warp-specialised ping-pong kernel.

Memory contract: nothing beyond C; S stages of (BLOCK_M + BLOCK_N) x BLOCK_K bf16 in shared memory.

One program per multiprocessor walks the used tiles of the device-built schedule. A one-warp loader
partition fills S shared-memory stages through TMA; two consumer warpgroups take alternate tiles, so
one runs its epilogue (the masked store of its rows) while the other runs its MMAs. Rows past the
expert's end are loaded (they belong to the next expert) but never stored. Gluon does not run under
the interpreter: this is measured against the tl kernel on a GPU before it replaces anything."""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

# the TMA load and the cp.async copy are async_copy_global_to_shared in triton 3.6, async_load (the old
# names removed) in 3.9
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
GATHER_WARPS = gl.constexpr(4)  # warps of the gathering loader: cp.async needs a thread per 16 bytes in flight


@gluon.jit
def _tile_of(j, pid, nprog, n_tn, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr):
    """(expert, first row, row end, column tile) of this program's j-th tile."""
    t = pid + j * nprog
    tile = t // n_tn
    e = gl.load(tile_expert_ptr + tile)
    return e, gl.load(tile_row_ptr + tile), gl.load(expert_offsets_ptr + e + 1), t % n_tn


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
            used_tiles_ptr, N, K_DIM):
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    n_tn = gl.cdiv(N, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    n_mine = gl.cdiv(gl.load(used_tiles_ptr) * n_tn - pid, nprog)
    for j in range(n_mine):
        e, row0, row_end, pid_n = _tile_of(j, pid, nprog, n_tn, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr)
        for k in range(n_k):
            c = j * n_k + k
            s = c % S
            mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)  # a fresh barrier passes phase 1
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [row0, k * BLOCK_K], ready.index(s), a_bufs.index(s))
            _tma_load(b_desc, [e * N + pid_n * BLOCK_N, k * BLOCK_K], ready.index(s),
                                            b_bufs.index(s))


@gluon.jit
def _gather_loader(x_ptr, stride_xl, token_ptr, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr,
                   expert_offsets_ptr, used_tiles_ptr, N, K_DIM):
    """As _loader, with A's rows gathered: row r of the tile is x[token[r]], copied by cp.async; each of
    the partition's threads arrives on the stage's barrier when its copies land (the barrier counts them)."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [GATHER_WARPS, 1], [1, 0])
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    n_tn = gl.cdiv(N, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    n_mine = gl.cdiv(gl.load(used_tiles_ptr) * n_tn - pid, nprog)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    for j in range(n_mine):
        e, row0, row_end, pid_n = _tile_of(j, pid, nprog, n_tn, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr)
        rmask = row0 + offs_m < row_end
        tok = gl.load(token_ptr + row0 + offs_m, mask=rmask, other=0)
        rows_ptr = x_ptr + tok.to(gl.int64)[:, None] * stride_xl
        for k in range(n_k):
            c = j * n_k + k
            s = c % S
            mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)
            # K_DIM is a multiple of BLOCK_K (checked on the host): a row mask alone keeps 16-byte copies
            _cp_async(a_bufs.index(s), rows_ptr + (k * BLOCK_K + offs_k)[None, :], mask=rmask[:, None])
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            mbarrier.expect(ready.index(s), b_desc.block_type.nbytes)
            _tma_load(b_desc, [e * N + pid_n * BLOCK_N, k * BLOCK_K], ready.index(s), b_bufs.index(s))


@gluon.jit
def _consumer(parity, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr,
              expert_offsets_ptr, used_tiles_ptr, N, K_DIM):
    """The tiles j ≡ parity (mod 2) of this program: MMAs over the loader's stages, then the store."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    n_tn = gl.cdiv(N, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    n_mine = gl.cdiv(gl.load(used_tiles_ptr) * n_tn - pid, nprog)
    for j in range(parity, n_mine, 2):
        e, row0, row_end, pid_n = _tile_of(j, pid, nprog, n_tn, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for k in range(n_k):
            c = j * n_k + k
            s = c % S
            mbarrier.wait(ready.index(s), (c // S) & 1)
            fence_async_shared()  # rows written by cp.async (generic proxy) before wgmma reads them (async proxy)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            # the MMA of step k-1 has finished: its stage goes back to the loader
            mbarrier.arrive(empty.index((c + S - 1) % S), pred=k > 0)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((j * n_k + n_k - 1) % S))
        # stored from the MMA's own layout: a layout conversion would go through shared-memory scratch,
        # which the two consumers would use at the same time
        out = acc.to(c_ptr.dtype.element_ty)
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cl + cols[None, :]
        gl.store(ptrs, out, mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@gluon.jit
def _consumer_odd(c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                  used_tiles_ptr, N, K_DIM):
    _consumer(1, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
              used_tiles_ptr, N, K_DIM)


@gluon.jit
def _consumer_even(c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                   used_tiles_ptr, N, K_DIM):
    _consumer(0, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
              used_tiles_ptr, N, K_DIM)


@gluon.jit
def rows_pingpong_kernel(a_desc, b_desc, c_ptr, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, expert_offsets_ptr,
                         N, K_DIM, stride_cl, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         STAGES: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    consumer_args = (c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                     used_tiles_ptr, N, K_DIM)
    gl.warp_specialize([
        (_consumer_even, consumer_args),
        (_consumer_odd, consumer_args),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                   used_tiles_ptr, N, K_DIM)),
    ], [4, 1], [232, 40])


@gluon.jit
def gathered_rows_pingpong_kernel(x_ptr, stride_xl, token_ptr, b_desc, c_ptr, tile_expert_ptr, tile_row_ptr,
                                  used_tiles_ptr, expert_offsets_ptr, N, K_DIM, stride_cl, BLOCK_M: gl.constexpr,
                                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """C[r] = x[token[r]] @ W[e]ᵀ: the up-projection's (and dH's) main loop, with A gathered by cp.async."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], b_desc.dtype)
    a_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        # every gathering thread arrives once its copies land, and the TMA's expect arrives once
        mbarrier.init(ready.index(s), count=32 * GATHER_WARPS + 1)
        mbarrier.init(empty.index(s), count=1)
    consumer_args = (c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                     used_tiles_ptr, N, K_DIM)
    gl.warp_specialize([
        (_consumer_even, consumer_args),
        (_consumer_odd, consumer_args),
        (_gather_loader, (x_ptr, stride_xl, token_ptr, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr,
                          tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, N, K_DIM)),
    ], [4, GATHER_WARPS], [224, 56])


def rows_pingpong(a, w, offsets, sched, out=None, block_n: int = 128, block_k: int = 64, stages: int = 4):
    """C (rows, N) = A[rows] @ W[e]ᵀ for each expert's contiguous rows; a (LK, K) and w (E, N, K) bf16/fp16,
    contiguous, K a multiple of 8 (16-byte rows for TMA); offsets (E+1,) int32; sched =
    ops.experts.tile_schedule(...) for BLOCK_M = 128."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from moeblaze.kernels.experts import BLOCK_M

    E, N, K = w.shape
    if K % 8 or not (a.is_contiguous() and w.is_contiguous()):
        raise ValueError(f"rows_pingpong needs contiguous operands with K % 8 == 0 (TMA rows), got K={K}")
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[a.dtype]
    la = gl.NVMMASharedLayout.get_default_for([BLOCK_M, block_k], gdt)
    lb = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gdt)
    a_desc = TensorDescriptor.from_tensor(a, [BLOCK_M, block_k], la)
    b_desc = TensorDescriptor.from_tensor(w.reshape(E * N, K), [block_n, block_k], lb)
    c = a.new_empty(a.shape[0], N) if out is None else out
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    # 12 warps (4 + 4 + 1, rounded to warpgroups) x 168 registers fill the register file; the workers ask
    # for 232 (consumer) and 40 (loader), the default consumer gets the rest
    rows_pingpong_kernel[(sms,)](a_desc, b_desc, c, sched[0], sched[1], sched[2], offsets, N, K, c.stride(0),
                                 BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=4,
                                 maxnreg=168)
    return c


def gathered_rows_pingpong(x, w, token, offsets, sched, out=None, block_n: int = 128, block_k: int = 64,
                           stages: int = 4):
    """C (rows, N) = x[token[rows]] @ W[e]ᵀ for each expert's contiguous rows; x (L, K) and w (E, N, K)
    bf16/fp16 contiguous, K a multiple of block_k; token (rows,) int32 (the routing index's token of each row)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from moeblaze.kernels.experts import BLOCK_M

    E, N, K = w.shape
    if K % block_k or not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError(f"gathered_rows_pingpong needs contiguous operands with K % {block_k} == 0, got K={K}")
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[x.dtype]
    b_desc = TensorDescriptor.from_tensor(w.reshape(E * N, K), [block_n, block_k],
                                          gl.NVMMASharedLayout.get_default_for([block_n, block_k], gdt))
    c = x.new_empty(token.shape[0], N) if out is None else out
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    gathered_rows_pingpong_kernel[(sms,)](x, x.stride(0), token, b_desc, c, sched[0], sched[1], sched[2], offsets, N, K,
                                          c.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
                                          STAGES=stages, num_warps=4, maxnreg=168)
    return c
