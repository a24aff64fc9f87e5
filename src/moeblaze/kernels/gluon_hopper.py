"""Hopper (sm_90) warp-specialised expert GEMMs in Gluon: the up-projection with its SwiGLU epilogue,
the row GEMMs of the down-projection and dX̃, and the weight gradients, used by ops.experts on sm_90 where
the shapes allow; the tl kernels in kernels.experts stay the path everywhere else (and the only one the
CPU interpreter runs).

Memory contract: nothing beyond the outputs (H and A; C; dW), and one 32 KB stand-in tensor per device and
dtype (a descriptor argument the up-projection needs when it stores H without TMA). Shared memory: S stages
of (128 + BLOCK_N) x 64 operands and, in all but the reference ping-pong and cooperative kernels, one
128 x 256 tile of the accumulator in the io dtype.

One program per multiprocessor walks the used tiles of the device-built schedule, GROUP_M row tiles
sweeping the columns together (the weight gradients: the tiles of dW, expert by expert). Partitions of
each program:
  loader    fills the stages: W through TMA; routed rows x[token[r]] through cp.async where gathered;
            the next tiles' schedule entries (and token ids) are read while this tile's stages are issued
  MMA       8 warps (two warpgroups, 64 rows each) over the stages, then hands the accumulator to
  epilogue  2 warps: stores it (down, dX̃: one TMA store for a tile within its expert, masked stores for
            the expert's last tile) or stores H and A = SiLU(gate)·up (up), while the MMA warps go on
            with the next tile.
Where a gathering loader feeds a plain store (dA', the weight gradients), the MMA warps store their own
tiles (the tile goes through shared memory either way, and a TMA store is one thread's work) and the
loader gets the whole fourth warpgroup: 4 warps of cp.async instead of 2 (1-3% faster at B, D and E).
The up-projection's stage holds 128 gate rows of W1 and the 128 matching up rows, so one 128x256 MMA
computes both halves. Rows past the expert's end are loaded (they belong to the next expert) but never
stored. The weight gradients reduce over the expert's rows: a stage is 64 rows of both sides, the
gathered side's rows past the expert's end zero-filled, and the loader reads the next stage's token ids
while it issues this one's copies. Also here, measured and kept for reference (scripts/gluon_bench.py):
ping-pong (two 4-warp consumers alternating 128x128 tiles) and cooperative kernels without the hand-off."""
import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .experts import BLOCK_M, tma_ok
from .launch import launch, sm_count

# the TMA load and store and the cp.async copy are async_copy_global_to_shared / async_copy_shared_to_global
# in triton 3.6, async_load / async_store in 3.9 (where the old load names are removed)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed in triton 3.9
GROUP_M = gl.constexpr(8)
GATHER_WARPS = gl.constexpr(4)  # warps of the gathering loader: cp.async needs a thread per 16 bytes in flight


@gluon.constexpr_function
def _gather_layout(block_k, warps):
    """The gathering loader's register layout: 8 elements (16 bytes, one cp.async) per thread along K."""
    return gl.BlockedLayout([1, 8], [32 * 8 // block_k, block_k // 8], [warps, 1], [1, 0])


@gluon.constexpr_function
def _acc_layout(warps, block_n):
    """The wgmma accumulator's register layout: `warps` warps down the rows, BLOCK_N columns per instruction."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_n, 16])


@gluon.constexpr_function
def _epilogue_layout(warps):
    """The epilogue partitions' register layout: EPI_ROWS x EPI_COLS pieces, 16 bytes per thread along a row."""
    return gl.BlockedLayout([1, 8], [32 * 8 // EPI_COLS, EPI_COLS // 8], [warps, 1], [1, 0])


@gluon.jit
def _my_tiles(used_tiles_ptr, n_tn):
    """(program id, programs, used row tiles, this program's count of the used_tiles x n_tn tiles)."""
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    n_used = gl.load(used_tiles_ptr)
    return pid, nprog, n_used, gl.cdiv(n_used * n_tn - pid, nprog)


@gluon.jit
def _stage_barriers(STAGES: gl.constexpr, READY_COUNT: gl.constexpr):
    """(ready, empty): one pair of barriers per stage; ready counts READY_COUNT arrivals, empty one."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=READY_COUNT)
        mbarrier.init(empty.index(s), count=1)
    return ready, empty


@gluon.jit
def _one_barrier():
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    return bar


@gluon.jit
def _mma_steps(acc, c0, n_k, a_bufs, b_bufs, ready, empty, fence, A_KM: gl.constexpr = False):
    """acc += the n_k stages c0 .. c0+n_k-1 of A @ B (B permuted unless its stages are (BLOCK_K, BLOCK_N);
    A permuted if A_KM: its stages are (BLOCK_K, BLOCK_M)), each stage handed back to the loader once the
    next MMA is issued; returns with the last MMA in flight. fence: an operand comes from cp.async
    (generic proxy), which wgmma (async proxy) must be fenced against."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[1] if A_KM else a_bufs.type.shape[2]
    B_KN: gl.constexpr = b_bufs.type.shape[2] != BLOCK_K
    for k in range(n_k):
        c = c0 + k
        s = c % S
        mbarrier.wait(ready.index(s), (c // S) & 1)
        if fence:
            fence_async_shared()
        a = a_bufs.index(s).permute((1, 0)) if A_KM else a_bufs.index(s)
        if B_KN:
            acc = warpgroup_mma(a, b_bufs.index(s), acc, is_async=True)
        else:
            acc = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        # the MMA of step k-1 has finished: its stage goes back to the loader
        mbarrier.arrive(empty.index((c + S - 1) % S), pred=k > 0)
    return acc


@gluon.jit
def _tile_start(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr):
    """(expert, first row, column tile) of this program's j-th tile. GROUP_M row tiles sweep the columns
    together, so each weight tile is read from L2 by all of them (an expert's weights can be larger than
    L2: W1 at config B is 64 MB)."""
    t = pid + j * nprog
    width = GROUP_M * n_tn
    first = (t // width) * GROUP_M
    size = gl.minimum(n_used - first, GROUP_M)
    tile = first + (t % width) % size
    return gl.load(tile_expert_ptr + tile), gl.load(tile_row_ptr + tile), (t % width) // size


@gluon.jit
def _tile_of(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr):
    """_tile_start and the tile's row end (its expert's end): (expert, first row, row end, column tile)."""
    e, row0, pid_n = _tile_start(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr)
    return e, row0, gl.load(expert_offsets_ptr + e + 1), pid_n


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, N, K_DIM):
    """Fills the stages through TMA: A's rows of the tile (past the expert's end, the next expert's rows:
    never stored); B as (BLOCK_N, BLOCK_K) boxes of W's (E·N, K) view, or (B_KN, stages of (BLOCK_K,
    BLOCK_N)) boxes of its (E·K, N) view. The next tile's schedule entry is loaded while this tile's stages
    are issued."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    B_KN: gl.constexpr = b_bufs.type.shape[2] != BLOCK_K
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if B_KN else b_bufs.type.shape[1]
    n_tn = gl.cdiv(N, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    pid, nprog, n_used, n_mine = _my_tiles(used_tiles_ptr, n_tn)
    if n_mine > 0:
        e, row0, pid_n = _tile_start(0, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr)
        for j in range(n_mine):
            # the last tile's entry again past the end: read, never used
            e1, row1, pid_n1 = _tile_start(gl.minimum(j + 1, n_mine - 1), pid, nprog, n_used, n_tn,
                                           tile_expert_ptr, tile_row_ptr)
            for k in range(n_k):
                c = j * n_k + k
                s = c % S
                mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)  # a fresh barrier passes phase 1
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [row0, k * BLOCK_K], ready.index(s), a_bufs.index(s))
                if B_KN:
                    _tma_load(b_desc, [e * K_DIM + k * BLOCK_K, pid_n * BLOCK_N], ready.index(s), b_bufs.index(s))
                else:
                    _tma_load(b_desc, [e * N + pid_n * BLOCK_N, k * BLOCK_K], ready.index(s), b_bufs.index(s))
            e, row0, pid_n = e1, row1, pid_n1


@gluon.jit
def _gather_loader(x_ptr, stride_xl, token_ptr, n_rows, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr,
                   tile_row_ptr, used_tiles_ptr, N, K_DIM):
    """As _loader, with A's rows gathered: row r of the tile is x[token[r]], copied by cp.async; each of
    the partition's threads arrives on the stage's barrier when its copies land (the barrier counts them).
    Rows past the expert's end are copied too (the next expert's tokens; never stored), so a tile needs
    only its first row, and the loads that find a tile run ahead: tile j+2's schedule entry and tile j+1's
    token ids are loaded while tile j's stages are issued, off the path from one tile's last stage to the
    next tile's first.
    GATED: W is (E·2N, K) with each expert's N gate rows before its N up rows; a stage's B holds
    BLOCK_N/2 gate rows then the matching BLOCK_N/2 up rows, so one MMA computes both halves.
    B_KN: W is (E·K, N) (W2 for dA' = dy[token] @ W2[e]), its stages (BLOCK_K, BLOCK_N) boxes."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    B_KN: gl.constexpr = b_bufs.type.shape[2] != BLOCK_K
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if B_KN else b_bufs.type.shape[1]
    TILE_N: gl.constexpr = b_desc.block_type.shape[1] if B_KN else b_desc.block_type.shape[0]
    GATED: gl.constexpr = TILE_N != BLOCK_N  # W's box is half the stage: gate, then up
    layout: gl.constexpr = _gather_layout(BLOCK_K, gl.num_warps())
    n_tn = gl.cdiv(N, TILE_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    pid, nprog, n_used, n_mine = _my_tiles(used_tiles_ptr, n_tn)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    if n_mine > 0:
        # the pipeline's first two tiles; past the last tile the entries repeat it, read but never used
        e, row0, pid_n = _tile_start(0, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr)
        e1, row1, pid_n1 = _tile_start(gl.minimum(1, n_mine - 1), pid, nprog, n_used, n_tn, tile_expert_ptr,
                                       tile_row_ptr)
        tok = gl.load(token_ptr + row0 + offs_m, mask=row0 + offs_m < n_rows, other=0)
        for j in range(n_mine):
            tok1 = gl.load(token_ptr + row1 + offs_m, mask=row1 + offs_m < n_rows, other=0)
            e2, row2, pid_n2 = _tile_start(gl.minimum(j + 2, n_mine - 1), pid, nprog, n_used, n_tn,
                                           tile_expert_ptr, tile_row_ptr)
            rows_ptr = x_ptr + tok.to(gl.int64)[:, None] * stride_xl + offs_k[None, :]
            for k in range(n_k):
                c = j * n_k + k
                s = c % S
                mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)  # a fresh barrier passes phase 1
                # W first: its TMA runs while the row copies are issued
                if GATED:
                    mbarrier.expect(ready.index(s), 2 * b_desc.block_type.nbytes)
                    gate_row = e * 2 * N + pid_n * TILE_N
                    stage = b_bufs.index(s)
                    _tma_load(b_desc, [gate_row, k * BLOCK_K], ready.index(s), stage.slice(0, TILE_N))
                    _tma_load(b_desc, [gate_row + N, k * BLOCK_K], ready.index(s), stage.slice(TILE_N, TILE_N))
                elif B_KN:
                    mbarrier.expect(ready.index(s), b_desc.block_type.nbytes)
                    _tma_load(b_desc, [e * K_DIM + k * BLOCK_K, pid_n * BLOCK_N], ready.index(s), b_bufs.index(s))
                else:
                    mbarrier.expect(ready.index(s), b_desc.block_type.nbytes)
                    _tma_load(b_desc, [e * N + pid_n * BLOCK_N, k * BLOCK_K], ready.index(s), b_bufs.index(s))
                # K_DIM is a multiple of BLOCK_K (checked on the host): every copy is a whole 16 bytes
                _cp_async(a_bufs.index(s), rows_ptr + k * BLOCK_K)
                async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            e, row0, pid_n, tok = e1, row1, pid_n1, tok1
            e1, row1, pid_n1 = e2, row2, pid_n2


@gluon.jit
def _consumer(first, STEP: gl.constexpr, WARPS: gl.constexpr, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, turn,
              tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, N, K_DIM, FENCE: gl.constexpr):
    """The tiles j = first, first + STEP, ... of this program: MMAs over the loader's stages, then the store.

    Ping-pong (STEP 2, one warpgroup each): the two consumers take turns through `turn`, whose j-th phase
    completes when tile j's MMAs are issued: tile j waits for phase j-1. Besides keeping one warpgroup on
    the tensor cores at a time, this is what makes the stage barriers' parity unambiguous: a consumer that
    ran ahead to stage c would find the barrier two phases back and pass on a stale parity.
    Cooperative (STEP 1, WARPS 8): both warpgroups share every tile, 64 rows each."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    acc_layout: gl.constexpr = _acc_layout(WARPS, BLOCK_N)
    n_tn = gl.cdiv(N, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    pid, nprog, n_used, n_mine = _my_tiles(used_tiles_ptr, n_tn)
    for j in range(first, n_mine, STEP):
        e, row0, row_end, pid_n = _tile_of(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr,
                                           expert_offsets_ptr)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        if STEP == 2:
            mbarrier.wait(turn.index(0), (j - 1) & 1)  # tile j-1's MMAs are issued (a fresh barrier passes j = 0)
        acc = _mma_steps(acc, j * n_k, n_k, a_bufs, b_bufs, ready, empty, FENCE)
        if STEP == 2:
            mbarrier.arrive(turn.index(0))  # the other consumer's tile j+1 may start its MMAs
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
def _consumer_even(c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, turn, tile_expert_ptr, tile_row_ptr,
                   expert_offsets_ptr, used_tiles_ptr, N, K_DIM, FENCE: gl.constexpr):
    _consumer(0, 2, 4, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, turn, tile_expert_ptr, tile_row_ptr,
              expert_offsets_ptr, used_tiles_ptr, N, K_DIM, FENCE)


@gluon.jit
def _consumer_odd(c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, turn, tile_expert_ptr, tile_row_ptr,
                  expert_offsets_ptr, used_tiles_ptr, N, K_DIM, FENCE: gl.constexpr):
    _consumer(1, 2, 4, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, turn, tile_expert_ptr, tile_row_ptr,
              expert_offsets_ptr, used_tiles_ptr, N, K_DIM, FENCE)


@gluon.jit
def _consumer_all(c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, turn, tile_expert_ptr, tile_row_ptr,
                  expert_offsets_ptr, used_tiles_ptr, N, K_DIM, FENCE: gl.constexpr):
    _consumer(0, 1, 8, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, turn, tile_expert_ptr, tile_row_ptr,
              expert_offsets_ptr, used_tiles_ptr, N, K_DIM, FENCE)


@gluon.jit
def rows_ws_kernel(a_desc, b_desc, c_ptr, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, expert_offsets_ptr, N, K_DIM,
                   stride_cl, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready, empty = _stage_barriers(STAGES, 1)
    turn = _one_barrier()
    consumer_args = (c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, turn, tile_expert_ptr, tile_row_ptr,
                     expert_offsets_ptr, used_tiles_ptr, N, K_DIM, False)
    loader_args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, N,
                   K_DIM)
    if PINGPONG:  # two 4-warp consumers on alternate tiles (the default partition is one of them)
        gl.warp_specialize([(_consumer_even, consumer_args), (_consumer_odd, consumer_args), (_loader, loader_args)],
                           [4, 1], [232, 40])
    else:  # one 8-warp consumer on every tile
        gl.warp_specialize([(_consumer_all, consumer_args), (_loader, loader_args)], [1], [40])


@gluon.jit
def gathered_rows_ws_kernel(x_ptr, stride_xl, token_ptr, n_rows, b_desc, c_ptr, tile_expert_ptr, tile_row_ptr,
                            used_tiles_ptr, expert_offsets_ptr, N, K_DIM, stride_cl, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                            PINGPONG: gl.constexpr):
    """C[r] = x[token[r]] @ W[e]ᵀ: the up-projection's (and dH's) main loop, with A gathered by cp.async."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], b_desc.dtype)
    a_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    # every gathering thread arrives once its copies land, and the TMA's expect arrives once
    ready, empty = _stage_barriers(STAGES, 32 * GATHER_WARPS + 1)
    turn = _one_barrier()
    consumer_args = (c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, turn, tile_expert_ptr, tile_row_ptr,
                     expert_offsets_ptr, used_tiles_ptr, N, K_DIM, True)
    loader_args = (x_ptr, stride_xl, token_ptr, n_rows, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr,
                   tile_row_ptr, used_tiles_ptr, N, K_DIM)
    if PINGPONG:
        gl.warp_specialize([(_consumer_even, consumer_args), (_consumer_odd, consumer_args),
                            (_gather_loader, loader_args)], [4, GATHER_WARPS], [224, 56])
    else:
        gl.warp_specialize([(_consumer_all, consumer_args), (_gather_loader, loader_args)], [GATHER_WARPS], [56])


def _desc(t, box):
    """A TMA descriptor of 2D t with the given box, in the swizzled shared layout wgmma reads."""
    return TensorDescriptor.from_tensor(t, box, _smem_layout(tuple(box), t.dtype))


@functools.cache
def _stand_in(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A BLOCK_M x 128 tensor for a descriptor argument a launch never uses (32 KB per device and dtype)."""
    return torch.zeros(BLOCK_M, 128, device=device, dtype=dtype)


@functools.cache
def _smem_layout(box: tuple, dtype: torch.dtype):
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), gdt)


def _launch_shape(pingpong: bool, block_n):
    """(BLOCK_N, num_warps): ping-pong tiles are 128x128 per warpgroup, cooperative ones 128x256 over two.
    Either way 12 warps x 168 registers fill the register file; the consumers get the most of them."""
    return (block_n or 128, 4) if pingpong else (block_n or 256, 8)


def rows_ws(a, w, offsets, sched, out=None, pingpong: bool = True, block_n=None, block_k: int = 64,
            stages: int = 4):
    """C (rows, N) = A[rows] @ W[e]ᵀ for each expert's contiguous rows; a (LK, K) and w (E, N, K) bf16/fp16,
    contiguous, K a multiple of 8 (16-byte rows for TMA); offsets (E+1,) int32; sched =
    ops.experts.tile_schedule(...) for BLOCK_M = 128."""
    E, N, K = w.shape
    if K % 8 or not (a.is_contiguous() and w.is_contiguous()):
        raise ValueError(f"rows_ws needs contiguous operands with K % 8 == 0 (TMA rows), got K={K}")
    block_n, warps = _launch_shape(pingpong, block_n)
    a_desc, b_desc = _desc(a, [BLOCK_M, block_k]), _desc(w.reshape(E * N, K), [block_n, block_k])
    c = a.new_empty(a.shape[0], N) if out is None else out
    grid = (sm_count(a.device),)
    launch(rows_ws_kernel, grid, a_desc, b_desc, c, sched[0], sched[1], sched[2], offsets, N, K, c.stride(0),
           BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PINGPONG=pingpong,
           num_warps=warps, maxnreg=168)
    return c


def gathered_rows_ws(x, w, token, offsets, sched, out=None, pingpong: bool = True, block_n=None, block_k: int = 64,
                     stages: int = 4):
    """C (rows, N) = x[token[rows]] @ W[e]ᵀ for each expert's contiguous rows; x (L, K) and w (E, N, K)
    bf16/fp16 contiguous, K a multiple of block_k; token (rows,) int32 (the routing index's token of each row)."""
    E, N, K = w.shape
    if K % block_k or not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError(f"gathered_rows_ws needs contiguous operands with K % {block_k} == 0, got K={K}")
    block_n, warps = _launch_shape(pingpong, block_n)
    b_desc = _desc(w.reshape(E * N, K), [block_n, block_k])
    c = x.new_empty(token.shape[0], N) if out is None else out
    grid = (sm_count(x.device),)
    launch(gathered_rows_ws_kernel, grid, x, x.stride(0), token, token.shape[0], b_desc, c, sched[0], sched[1],
           sched[2], offsets, N, K, c.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
           STAGES=stages, PINGPONG=pingpong, num_warps=warps, maxnreg=168)
    return c


# ---- up-projection: MMAs in two warpgroups, the SwiGLU epilogue in its own partition ----------------------
# 8 MMA warps + 2 loader warps + 2 epilogue warps = 12: at 168 registers each on average, the MMA warps can
# have 200 (wgmma with a 128-register accumulator needs ~154 to compile); the loader and epilogue share one
# warpgroup and so one register count (a 14th warp would leave the MMA warps fewer than ~154 registers)
UP_LOADER_WARPS = gl.constexpr(2)
EPI_WARPS = gl.constexpr(2)
EPI_ROWS = gl.constexpr(32)  # the epilogue walks the tile in 32x64 pieces of gate (and the matching up)
EPI_COLS = gl.constexpr(64)


@gluon.jit
def _handoff_mma(c_smem, acc_ready, acc_empty, a_bufs, b_bufs, ready, empty, used_tiles_ptr, n_tn, K_DIM, fence):
    """Every tile of this program: MMAs over the loader's stages (both warpgroups, 64 rows each), then the
    accumulator into c_smem (io dtype) for the epilogue partition, which drains it during the next tile."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    B_KN: gl.constexpr = b_bufs.type.shape[2] != BLOCK_K  # stages of (BLOCK_K, BLOCK_N): no permute
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if B_KN else b_bufs.type.shape[1]
    acc_layout: gl.constexpr = _acc_layout(8, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    pid, nprog, n_used, n_mine = _my_tiles(used_tiles_ptr, n_tn)
    for j in range(n_mine):
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc = _mma_steps(acc, j * n_k, n_k, a_bufs, b_bufs, ready, empty, fence)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((j * n_k + n_k - 1) % S))
        mbarrier.wait(acc_empty.index(0), (j & 1) ^ 1)  # the epilogue has read tile j-1
        c_smem.store(acc.to(c_smem.dtype))
        fence_async_shared()  # the epilogue may hand c_smem to a TMA store (async proxy)
        mbarrier.arrive(acc_ready.index(0))


@gluon.jit
def _store_tile(acc, c_smem, c_desc, c_ptr, stride_cl, row0, row_end, col0, N):
    """The MMA partition's own store of a finished tile: through c_smem and one TMA store where the tile lies
    within its rows (row0 + BLOCK_M <= row_end), else masked stores from the registers. c_smem is written only
    once the previous tile's TMA store has read it."""
    BLOCK_M: gl.constexpr = c_smem.type.shape[0]
    BLOCK_N: gl.constexpr = c_smem.type.shape[1]
    if row0 + BLOCK_M <= row_end:
        tma.store_wait(0)
        _thread_barrier()  # every thread sees the previous store done before it overwrites c_smem
        c_smem.store(acc.to(c_smem.dtype))
        fence_async_shared()
        _thread_barrier()  # the whole tile is in c_smem before the TMA store reads it
        _tma_store(c_desc, [row0, col0], c_smem)
    else:
        acc_layout: gl.constexpr = acc.type.layout
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        gl.store(c_ptr + rows.to(gl.int64)[:, None] * stride_cl + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@gluon.jit
def _mma_store(c_smem, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr,
               expert_offsets_ptr, used_tiles_ptr, N, K_DIM):
    """_handoff_mma that stores each tile itself (_store_tile) instead of handing it to a store partition:
    the tile is written to c_smem anyway, and a TMA store is one thread's work, so the warps a store
    partition would take go to the gathering loader instead."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    acc_layout: gl.constexpr = _acc_layout(8, BLOCK_N)
    n_tn = gl.cdiv(N, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    pid, nprog, n_used, n_mine = _my_tiles(used_tiles_ptr, n_tn)
    for j in range(n_mine):
        e, row0, row_end, pid_n = _tile_of(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr,
                                           expert_offsets_ptr)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc = _mma_steps(acc, j * n_k, n_k, a_bufs, b_bufs, ready, empty, True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((j * n_k + n_k - 1) % S))
        _store_tile(acc, c_smem, c_desc, c_ptr, stride_cl, row0, row_end, pid_n * BLOCK_N, N)
    tma.store_wait(0)


@gluon.jit
def _up_epilogue(c_smem, acc_ready, acc_empty, h_desc, preact_ptr, act_ptr, stride_pl, stride_al, tile_expert_ptr,
                 tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, H, STORE_PREACT: gl.constexpr,
                 STORE_ACT: gl.constexpr, TMA_PREACT: gl.constexpr):
    """Each tile's H = [gate | up] from c_smem: stores H (if STORE_PREACT) and A = SiLU(gate) * up (if
    STORE_ACT), in 32x64 pieces with coalesced 16-byte stores; the stored H is what backward reads, and A
    is computed from it. With TMA_PREACT, a tile within its expert's rows and H's columns stores its two
    halves of H by TMA (h_desc: boxes of BLOCK_M x HALF of H), so the two warps store only A."""
    BLOCK_M: gl.constexpr = c_smem.type.shape[0]
    HALF: gl.constexpr = c_smem.type.shape[1] // 2
    layout: gl.constexpr = _epilogue_layout(gl.num_warps())
    n_tn = gl.cdiv(H, HALF)
    pid, nprog, n_used, n_mine = _my_tiles(used_tiles_ptr, n_tn)
    offs_m = gl.arange(0, EPI_ROWS, layout=gl.SliceLayout(1, layout))
    offs_n = gl.arange(0, EPI_COLS, layout=gl.SliceLayout(0, layout))
    for j in range(n_mine):
        e, row0, row_end, pid_n = _tile_of(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr,
                                           expert_offsets_ptr)
        mbarrier.wait(acc_ready.index(0), j & 1)
        # TMA_PREACT (only with STORE_PREACT): H's halves by TMA for a tile within H's rows and columns
        by_tma = (row0 + BLOCK_M <= row_end) & ((pid_n + 1) * HALF <= H) & TMA_PREACT
        if by_tma:
            _tma_store(h_desc, [row0, pid_n * HALF], c_smem.slice(0, HALF, dim=1))
            _tma_store(h_desc, [row0, H + pid_n * HALF], c_smem.slice(HALF, HALF, dim=1))
        for rh in gl.static_range(BLOCK_M // EPI_ROWS):
            rows = row0 + rh * EPI_ROWS + offs_m
            rmask = rows < row_end
            for ch in gl.static_range(HALF // EPI_COLS):
                piece = c_smem.slice(rh * EPI_ROWS, EPI_ROWS, dim=0)
                gate = piece.slice(ch * EPI_COLS, EPI_COLS, dim=1).load(layout)
                up = piece.slice(HALF + ch * EPI_COLS, EPI_COLS, dim=1).load(layout)
                cols = pid_n * HALF + ch * EPI_COLS + offs_n
                mask = rmask[:, None] & (cols < H)[None, :]
                if STORE_PREACT:
                    p_ptrs = preact_ptr + rows.to(gl.int64)[:, None] * stride_pl + cols[None, :]
                    pmask = mask & (not by_tma)
                    gl.store(p_ptrs, gate, mask=pmask)
                    gl.store(p_ptrs + H, up, mask=pmask)
                if STORE_ACT:
                    g = gate.to(gl.float32)
                    a = g / (1.0 + gl.exp(-g)) * up.to(gl.float32)
                    a_ptrs = act_ptr + rows.to(gl.int64)[:, None] * stride_al + cols[None, :]
                    gl.store(a_ptrs, a.to(act_ptr.dtype.element_ty), mask=mask)
        if TMA_PREACT:
            tma.store_wait(0)  # c_smem read: the MMA warps may overwrite it
        mbarrier.arrive(acc_empty.index(0))


@gluon.jit
def up_swiglu_ws_kernel(x_ptr, stride_xl, token_ptr, n_rows, w_desc, h_desc, preact_ptr, act_ptr, stride_pl,
                        stride_al, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, expert_offsets_ptr, H, K_DIM,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                        STORE_PREACT: gl.constexpr, STORE_ACT: gl.constexpr, TMA_PREACT: gl.constexpr,
                        WORKER_REGS: gl.constexpr):
    """H = x[token[rows]] @ W1[e]ᵀ (gate and up), A = SiLU(gate) * up; three partitions: the 8-warp MMA
    partition (default), a 2-warp gathering loader, a 2-warp epilogue."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], w_desc.dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], w_desc.dtype)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], w_desc.dtype)
    a_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_layout)
    c_smem = gl.allocate_shared_memory(w_desc.dtype, [BLOCK_M, BLOCK_N], c_layout)
    ready, empty = _stage_barriers(STAGES, 32 * UP_LOADER_WARPS + 1)
    acc_ready, acc_empty = _one_barrier(), _one_barrier()
    mma_args = (c_smem, acc_ready, acc_empty, a_bufs, b_bufs, ready, empty, used_tiles_ptr, gl.cdiv(H, BLOCK_N // 2),
                K_DIM, True)
    loader_args = (x_ptr, stride_xl, token_ptr, n_rows, w_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr,
                   tile_row_ptr, used_tiles_ptr, H, K_DIM)
    epi_args = (c_smem, acc_ready, acc_empty, h_desc, preact_ptr, act_ptr, stride_pl, stride_al, tile_expert_ptr,
                tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, H, STORE_PREACT, STORE_ACT, TMA_PREACT)
    gl.warp_specialize([(_handoff_mma, mma_args), (_gather_loader, loader_args), (_up_epilogue, epi_args)],
                       [UP_LOADER_WARPS, EPI_WARPS], [WORKER_REGS, WORKER_REGS])


@gluon.jit
def _store_epilogue(c_smem, acc_ready, acc_empty, c_desc, c_ptr, stride_cl, tile_expert_ptr, tile_row_ptr,
                    expert_offsets_ptr, used_tiles_ptr, N):
    """Each tile from c_smem to C's rows: a tile of the expert's rows alone by one TMA store; the expert's
    last tile, whose rows run past its end, in pieces with masked stores."""
    BLOCK_M: gl.constexpr = c_smem.type.shape[0]
    BLOCK_N: gl.constexpr = c_smem.type.shape[1]
    n_tn = gl.cdiv(N, BLOCK_N)
    pid, nprog, n_used, n_mine = _my_tiles(used_tiles_ptr, n_tn)
    for j in range(n_mine):
        e, row0, row_end, pid_n = _tile_of(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr,
                                           expert_offsets_ptr)
        mbarrier.wait(acc_ready.index(0), j & 1)
        if row0 + BLOCK_M <= row_end:
            _tma_store(c_desc, [row0, pid_n * BLOCK_N], c_smem)
            tma.store_wait(0)  # c_smem read: the MMA warps may overwrite it
        else:
            _store_pieces(c_smem, c_ptr, stride_cl, row0, row_end, pid_n * BLOCK_N, N)
        mbarrier.arrive(acc_empty.index(0))


@gluon.jit
def _store_pieces(c_smem, c_ptr, stride_cl, row0, row_end, col0, N):
    """c_smem to C[row0:row_end, col0:N] (rows and columns past them masked), in EPI_ROWS x EPI_COLS pieces
    with coalesced 16-byte stores."""
    BLOCK_M: gl.constexpr = c_smem.type.shape[0]
    BLOCK_N: gl.constexpr = c_smem.type.shape[1]
    layout: gl.constexpr = _epilogue_layout(gl.num_warps())
    offs_m = gl.arange(0, EPI_ROWS, layout=gl.SliceLayout(1, layout))
    offs_n = gl.arange(0, EPI_COLS, layout=gl.SliceLayout(0, layout))
    for rh in gl.static_range(BLOCK_M // EPI_ROWS):
        rows = row0 + rh * EPI_ROWS + offs_m
        for ch in gl.static_range(BLOCK_N // EPI_COLS):
            piece = c_smem.slice(rh * EPI_ROWS, EPI_ROWS, dim=0).slice(ch * EPI_COLS, EPI_COLS, dim=1)
            cols = col0 + ch * EPI_COLS + offs_n
            gl.store(c_ptr + rows.to(gl.int64)[:, None] * stride_cl + cols[None, :], piece.load(layout),
                     mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@gluon.jit
def rows_handoff_kernel(a_desc, b_desc, c_desc, c_ptr, tile_expert_ptr, tile_row_ptr, used_tiles_ptr,
                        expert_offsets_ptr, N, K_DIM, stride_cl, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        BLOCK_K: gl.constexpr, STAGES: gl.constexpr, WORKER_REGS: gl.constexpr, B_KN: gl.constexpr):
    """C[rows] = A[rows] @ B[e]ᵀ with 128x256 tiles: the 8-warp MMA partition hands each accumulator to a
    2-warp store partition through shared memory and goes on with the next tile; a 1-warp TMA loader.
    B_KN: B[e] is (K, N) with N contiguous (W1 for dX̃ = dH @ W1[e]), else (N, K) (W2 for the down-projection)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    if B_KN:
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    else:
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    c_smem = gl.allocate_shared_memory(a_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    ready, empty = _stage_barriers(STAGES, 1)
    acc_ready, acc_empty = _one_barrier(), _one_barrier()
    mma_args = (c_smem, acc_ready, acc_empty, a_bufs, b_bufs, ready, empty, used_tiles_ptr, gl.cdiv(N, BLOCK_N), K_DIM,
                False)
    loader_args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, N,
                   K_DIM)
    epi_args = (c_smem, acc_ready, acc_empty, c_desc, c_ptr, stride_cl, tile_expert_ptr, tile_row_ptr,
                expert_offsets_ptr, used_tiles_ptr, N)
    gl.warp_specialize([(_handoff_mma, mma_args), (_loader, loader_args), (_store_epilogue, epi_args)],
                       [1, EPI_WARPS], [WORKER_REGS, WORKER_REGS])


@gluon.jit
def gathered_handoff_kernel(x_ptr, stride_xl, token_ptr, n_rows, b_desc, c_desc, c_ptr, stride_cl, tile_expert_ptr,
                            tile_row_ptr, used_tiles_ptr, expert_offsets_ptr, N, K_DIM, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                            WORKER_REGS: gl.constexpr):
    """C[rows] = x[token[rows]] @ W[e], W (E·K, N): 8 MMA warps that store their own tiles, behind a gathering
    loader of a whole warpgroup."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], b_desc.dtype)
    a_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    c_smem = gl.allocate_shared_memory(b_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    ready, empty = _stage_barriers(STAGES, 32 * GATHER_WARPS + 1)
    mma_args = (c_smem, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr,
                expert_offsets_ptr, used_tiles_ptr, N, K_DIM)
    loader_args = (x_ptr, stride_xl, token_ptr, n_rows, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr,
                   tile_row_ptr, used_tiles_ptr, N, K_DIM)
    gl.warp_specialize([(_mma_store, mma_args), (_gather_loader, loader_args)], [GATHER_WARPS], [WORKER_REGS])


def gathered_handoff(x, w, token, offsets, sched, out=None, block_k: int = 64, stages: int = 3,
                     worker_regs: int = 56):
    """C (rows, N) = x[token[rows]] @ W[e] for each expert's contiguous rows (dA' = dy[token] @ W2[e]); x (L, K)
    and w (E, K, N) bf16/fp16 contiguous, K a multiple of block_k, N of 8; token (rows,) int32."""
    E, K, N = w.shape
    c = x.new_empty(token.shape[0], N) if out is None else out
    if K % block_k or N % 8 or not (x.is_contiguous() and w.is_contiguous() and c.is_contiguous()):
        raise ValueError(f"gathered_handoff needs contiguous operands with K % {block_k} == 0 and N % 8 == 0, got "
                         f"x {tuple(x.shape)}, W {tuple(w.shape)}, C {tuple(c.shape)}")
    block_n = 256
    b_desc = _desc(w.reshape(E * K, N), [block_k, block_n])
    c_desc = _desc(c, [BLOCK_M, block_n])
    grid = (sm_count(x.device),)
    launch(gathered_handoff_kernel, grid, x, x.stride(0), token, token.shape[0], b_desc, c_desc, c, c.stride(0),
           sched[0], sched[1], sched[2], offsets, N, K, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
           STAGES=stages, WORKER_REGS=worker_regs, num_warps=8, maxnreg=168)
    return c


def rows_handoff(a, w, offsets, sched, out=None, kn: bool = False, block_k: int = 64, stages: int = 3,
                 worker_regs: int = 112):
    """C (rows, N) = A[rows] @ W[e]ᵀ, w (E, N, K), or with kn = A[rows] @ W[e], w (E, K, N), for each expert's
    contiguous rows; bf16/fp16, contiguous, K and N multiples of 8 (16-byte TMA rows). 128x256 tiles whose
    stores run in their own partition beside the next tile's MMAs."""
    E, K, N = w.shape if kn else (w.shape[0], w.shape[2], w.shape[1])
    c = a.new_empty(a.shape[0], N) if out is None else out
    if K % 8 or N % 8 or not (a.is_contiguous() and w.is_contiguous() and c.is_contiguous()):
        raise ValueError(f"rows_handoff needs contiguous operands with K and N multiples of 8, got A "
                         f"{tuple(a.shape)}, W {tuple(w.shape)}, C {tuple(c.shape)}")
    block_n = 256
    a_desc = _desc(a, [BLOCK_M, block_k])
    b_desc = _desc(w.reshape(-1, w.shape[2]), [block_k, block_n] if kn else [block_n, block_k])
    c_desc = _desc(c, [BLOCK_M, block_n])
    grid = (sm_count(a.device),)
    launch(rows_handoff_kernel, grid, a_desc, b_desc, c_desc, c, sched[0], sched[1], sched[2], offsets, N, K,
           c.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
           WORKER_REGS=worker_regs, B_KN=kn, num_warps=8, maxnreg=168)
    return c


def up_swiglu_ws(x, w1, token, offsets, sched, preact=None, act=None, store_preact: bool = True,
                 store_act: bool = True, block_k: int = 64, stages: int = 3, worker_regs: int = 112):
    """The SwiGLU up-projection: H (rows, 2h) = x[token[rows]] @ W1[e]ᵀ and A (rows, h) = SiLU(H[:, :h]) *
    H[:, h:], for each expert's contiguous rows; x (L, d), w1 (E, 2h, d) bf16/fp16 contiguous, d a
    multiple of block_k. Returns (H or None, A or None): H if store_preact, A if store_act (backward's
    recompute stores H alone)."""
    E, two_h, d = w1.shape
    h = two_h // 2
    if d % block_k or not (x.is_contiguous() and w1.is_contiguous()):
        raise ValueError(f"up_swiglu_ws needs contiguous operands with d % {block_k} == 0, got d={d}")
    block_n = 256  # 128 gate columns and the matching 128 up columns
    w_desc = _desc(w1.reshape(E * two_h, d), [block_n // 2, block_k])
    rows = token.shape[0]
    if not (store_preact or store_act):
        raise ValueError("up_swiglu_ws stores H, A or both")
    if store_preact and preact is None:
        preact = x.new_empty(rows, two_h)
    if store_act and act is None:
        act = x.new_empty(rows, h)
    p = preact if store_preact else act
    a = act if store_act else preact
    # H's halves of a tile go out by TMA where H's rows are 16-byte aligned (a descriptor can address them)
    tma_preact = store_preact and tma_ok(preact)
    # (without it the kernel never stores through h_desc; the partitions see TMA_PREACT at run time, so a
    # descriptor of a small stand-in tensor takes its place)
    h_desc = _desc(preact if tma_preact else _stand_in(x.device, x.dtype), [BLOCK_M, block_n // 2])
    # 12 warps x 168 registers fill the register file: the loader and epilogue warpgroup gets
    # worker_regs, the MMA warps the rest
    grid = (sm_count(x.device),)
    launch(up_swiglu_ws_kernel, grid, x, x.stride(0), token, rows, w_desc, h_desc, p, a, p.stride(0), a.stride(0),
           sched[0], sched[1], sched[2], offsets, h, d, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
           STAGES=stages, STORE_PREACT=store_preact, STORE_ACT=store_act, TMA_PREACT=tma_preact,
           WORKER_REGS=worker_regs, num_warps=8, maxnreg=168)
    return (preact if store_preact else None), (act if store_act else None)



# ---- weight gradients: dW[e] = P[rows of e]ᵀ Q[rows of e], one side gathered ------------------------------
# the reduction runs over the expert's rows, so the gathered side needs new token ids every stage: the
# loader reads the next stage's ids while it issues this stage's copies
WGRAD_BLOCKS = (128, 256)  # (BLOCK_M: P's columns per tile of dW, BLOCK_N: Q's columns)


@gluon.jit
def _wgrad_tile(j, pid, nprog, n_tm, n_tn, group):
    """(expert, row tile of dW[e], column tile) of this program's j-th tile: expert by expert, so the
    programs running together read the same rows of P and Q (from L2); within an expert, `group` row tiles
    sweep the columns together (wgrad_group). The grouped arithmetic only where group > 1: it sits on the MMA
    warps' path from one tile to the next (B's dW1 ran 2% slower with it in the same order)."""
    t = pid + j * nprog
    r = t % (n_tm * n_tn)
    tm = r // n_tn
    tn = r % n_tn
    if group > 1:
        width = group * n_tn
        first = (r // width) * group
        size = gl.minimum(n_tm - first, group)
        tm = first + (r % width) % size
        tn = (r % width) // size
    return t // (n_tm * n_tn), tm, tn


def wgrad_group(n_tm: int, n_tn: int) -> int:
    """Row tiles of dW[e] that sweep its columns together. One row tile at a time (the columns fastest) while
    dW[e] has at least twice as many row tiles as column tiles: a wave of ~132 tiles then holds every column
    tile of Q (256 wide) and a band of P's (128 wide). Otherwise 16 row tiles at a time: with the columns
    fastest a wave would stream through all of Q[e] (64 MB for dW2 at config B), where 16 x ~8 tiles hold
    the least of P and Q for that many tiles. Measured at configs A-E: each choice within 0-1.5% of the
    other where that one wins, the grouped order 6-8% faster for dW2 at B and 3-4% for dW1 at E
    (bench/results/nvidia-h200-wgrad-order.log)."""
    return 1 if n_tm >= 2 * n_tn else 16


@gluon.jit
def _wgrad_loader(dense_desc, src_ptr, stride_src, token_ptr, p_bufs, q_bufs, ready, empty, expert_offsets_ptr,
                  n_tiles, n_tm, n_tn, group):
    """Stages of BLOCK_K rows of P (BLOCK_K x BLOCK_M) and Q (BLOCK_K x BLOCK_N): the dense side through TMA
    (its rows past the expert's end are the next expert's, or TMA's zeros past the tensor), the gathered
    side src[token[r]] through cp.async with the rows past the expert's end zero-filled, so they add
    nothing. (A non-finite value in the next expert's dense rows would still reach this expert's sum:
    0 x inf; a step with one has no usable gradients anyway.)"""
    S: gl.constexpr = p_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = p_bufs.type.shape[1]
    BLOCK_M: gl.constexpr = p_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = q_bufs.type.shape[2]
    gl.static_assert(BLOCK_M != BLOCK_N)
    GATHER_P: gl.constexpr = dense_desc.block_type.shape[1] == BLOCK_N  # the dense side is the one TMA loads
    WIDTH: gl.constexpr = BLOCK_M if GATHER_P else BLOCK_N
    layout: gl.constexpr = _gather_layout(64, gl.num_warps())
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    n_mine = gl.cdiv(n_tiles - pid, nprog)
    offs_r = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    offs_c = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    if n_mine > 0:
        e, tm, tn = _wgrad_tile(0, pid, nprog, n_tm, n_tn, group)
        start, end = gl.load(expert_offsets_ptr + e), gl.load(expert_offsets_ptr + e + 1)
        tok = gl.load(token_ptr + start + offs_r, mask=start + offs_r < end, other=0)
        c = 0
        for j in range(n_mine):
            # the next tile (the last one again past the end: read, never used)
            e1, tm1, tn1 = _wgrad_tile(gl.minimum(j + 1, n_mine - 1), pid, nprog, n_tm, n_tn, group)
            start1, end1 = gl.load(expert_offsets_ptr + e1), gl.load(expert_offsets_ptr + e1 + 1)
            src_cols = src_ptr + ((tm * BLOCK_M) if GATHER_P else (tn * BLOCK_N)) + offs_c
            dense_col = (tn * BLOCK_N) if GATHER_P else (tm * BLOCK_M)
            n_k = gl.cdiv(end - start, BLOCK_K)
            for k in range(n_k):
                row = start + k * BLOCK_K
                # the next stage's token ids, loaded while this stage is issued: this tile's next rows or
                # the next tile's first
                if k + 1 < n_k:
                    next_row = row + BLOCK_K
                    next_end = end
                else:
                    next_row = start1
                    next_end = end1
                tok1 = gl.load(token_ptr + next_row + offs_r, mask=next_row + offs_r < next_end, other=0)
                s = c % S
                mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)  # a fresh barrier passes phase 1
                mbarrier.expect(ready.index(s), dense_desc.block_type.nbytes)
                ptrs = src_cols[None, :] + tok.to(gl.int64)[:, None] * stride_src
                rmask = (row + offs_r < end)[:, None]
                if GATHER_P:
                    _tma_load(dense_desc, [row, dense_col], ready.index(s), q_bufs.index(s))
                    _cp_async(p_bufs.index(s), ptrs, mask=rmask)
                else:
                    _tma_load(dense_desc, [row, dense_col], ready.index(s), p_bufs.index(s))
                    _cp_async(q_bufs.index(s), ptrs, mask=rmask)
                async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
                tok = tok1
                c += 1
            if n_k == 0:  # an expert without rows: nothing read ahead
                tok = gl.load(token_ptr + start1 + offs_r, mask=start1 + offs_r < end1, other=0)
            e, tm, tn, start, end = e1, tm1, tn1, start1, end1


@gluon.jit
def _wgrad_mma_store(c_smem, c_desc, c_ptr, stride_cl, p_bufs, q_bufs, ready, empty, expert_offsets_ptr, n_tiles, n_tm,
                     n_tn, group, M, N):
    """Each dW tile: Pᵀ (P's stages read transposed) times Q over the expert's rows, then stored by these warps
    (_store_tile, keeping to the expert's M rows). An expert without rows stores zeros."""
    S: gl.constexpr = p_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = p_bufs.type.shape[1]
    BLOCK_M: gl.constexpr = p_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = q_bufs.type.shape[2]
    acc_layout: gl.constexpr = _acc_layout(8, BLOCK_N)
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    c0 = 0
    for j in range(gl.cdiv(n_tiles - pid, nprog)):
        e, tm, tn = _wgrad_tile(j, pid, nprog, n_tm, n_tn, group)
        n_k = gl.cdiv(gl.load(expert_offsets_ptr + e + 1) - gl.load(expert_offsets_ptr + e), BLOCK_K)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc = _mma_steps(acc, c0, n_k, p_bufs, q_bufs, ready, empty, True, A_KM=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((c0 + n_k + S - 1) % S), pred=n_k > 0)
        c0 += n_k
        _store_tile(acc, c_smem, c_desc, c_ptr, stride_cl, e * M + tm * BLOCK_M, e * M + M, tn * BLOCK_N, N)
    tma.store_wait(0)


@gluon.jit
def weight_grad_ws_kernel(dense_desc, src_ptr, stride_src, token_ptr, c_desc, c_ptr, stride_cl, expert_offsets_ptr,
                          E, M, N, GROUP, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                          STAGES: gl.constexpr, WORKER_REGS: gl.constexpr):
    """dW[e] (M, N) = P[rows of e]ᵀ Q[rows of e] for every expert: 8 MMA warps that store their own tiles, and a
    loader of a whole warpgroup (TMA for the dense side, cp.async for the gathered one; which is which, the
    dense side's box tells)."""
    dtype: gl.constexpr = dense_desc.dtype
    p_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_M],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_M], dtype))
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype))
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    ready, empty = _stage_barriers(STAGES, 32 * GATHER_WARPS + 1)
    n_tm, n_tn = gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N)
    n_tiles = E * n_tm * n_tn
    mma_args = (c_smem, c_desc, c_ptr, stride_cl, p_bufs, q_bufs, ready, empty, expert_offsets_ptr, n_tiles, n_tm, n_tn,
                GROUP, M, N)
    loader_args = (dense_desc, src_ptr, stride_src, token_ptr, p_bufs, q_bufs, ready, empty, expert_offsets_ptr,
                   n_tiles, n_tm, n_tn, GROUP)
    gl.warp_specialize([(_wgrad_mma_store, mma_args), (_wgrad_loader, loader_args)], [GATHER_WARPS], [WORKER_REGS])


def weight_grad_ws(p, q, token, offsets, out, gather_p: bool, block_k: int = 64, stages: int = 3,
                   worker_regs: int = 56):
    """out[e] (M, N) = P[rows of e]ᵀ Q[rows of e] for each expert's contiguous rows (offsets (E+1,) int32), with
    P = p[token[rows]], Q = q[rows] if gather_p, else P = p[rows], Q = q[token[rows]]; token (rows,) int32.
    bf16/fp16, contiguous, out in the operands' dtype; the gathered side's width a multiple of its block
    (WGRAD_BLOCKS: 128 for P, 256 for Q), the dense side's and N multiples of 8 (16-byte TMA rows)."""
    E, M, N = out.shape
    block_m, block_n = WGRAD_BLOCKS
    dense, src = (q, p) if gather_p else (p, q)
    width = block_m if gather_p else block_n
    if (src.shape[1] % width or dense.shape[1] % 8 or N % 8 or out.dtype != p.dtype or q.dtype != p.dtype
            or not (p.is_contiguous() and q.is_contiguous() and out.is_contiguous())):
        raise ValueError(f"weight_grad_ws needs contiguous operands of one dtype, the gathered one's width a "
                         f"multiple of {width}, the dense one's and N multiples of 8; got P {tuple(p.shape)}, "
                         f"Q {tuple(q.shape)}, dW {tuple(out.shape)} {out.dtype}")
    dense_desc = _desc(dense, [block_k, block_n if gather_p else block_m])
    c2d = out.view(E * M, N)
    c_desc = _desc(c2d, [block_m, block_n])
    grid = (sm_count(p.device),)
    group = wgrad_group(triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    launch(weight_grad_ws_kernel, grid, dense_desc, src, src.stride(0), token, c_desc, c2d, c2d.stride(0), offsets,
           E, M, N, group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, WORKER_REGS=worker_regs,
           num_warps=8, maxnreg=168)
    return out
