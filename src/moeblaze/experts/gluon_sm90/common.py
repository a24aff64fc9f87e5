"""What the Hopper (sm_90) Gluon kernels share: Triton-version shims, register and shared layouts, the stage
barriers, the MMA loop over the stages, the persistent walk over the device-built tile schedule, the MMA
warps' own tile stores (through shared memory, or straight from registers for a float32 C), and the host-side TMA
descriptors.

One program per multiprocessor walks the used tiles of the schedule, GROUP_M row tiles sweeping the columns
together (the weight gradients: the tiles of dW, expert by expert). The MMA partition is 8 warps (two
warpgroups, 64 rows each); loaders and store partitions are in partitions.py.

Memory contract: nothing beyond the kernels' outputs, and one 32 KB stand-in tensor per device and dtype
(stand_in: a descriptor argument the up-projection needs when it stores H without TMA).
"""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..schedule import BLOCK_M

# the TMA load and store and the cp.async copy are async_copy_global_to_shared / async_copy_shared_to_global
# in triton 3.6, async_load / async_store in 3.9 (where the old load names are removed)
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed in triton 3.9


GROUP_M = gl.constexpr(8)


GATHER_WARPS = gl.constexpr(4)  # warps of the gathering loader: cp.async needs a thread per 16 bytes in flight

EPI_ROWS = gl.constexpr(32)  # epilogues walk a tile in 32x64 pieces (of gate, and the matching up)
EPI_COLS = gl.constexpr(64)


@gluon.constexpr_function
def gather_layout(block_k, warps, elem_bits=16):
    """The gathering loader's register layout: 16 bytes (one cp.async) per thread along K."""
    vec = 128 // elem_bits
    return gl.BlockedLayout([1, vec], [32 * vec // block_k, block_k // vec], [warps, 1], [1, 0])


@gluon.constexpr_function
def mma_layout(warps, block_n, instr_k=16):
    """The wgmma accumulator's register layout: `warps` warps down the rows, BLOCK_N columns per instruction,
    instr_k deep (16 for 16-bit operands, 32 for 8-bit)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_n, instr_k])


@gluon.constexpr_function
def epilogue_layout(warps):
    """The epilogue partitions' register layout: EPI_ROWS x EPI_COLS pieces, 16 bytes per thread along a row."""
    return gl.BlockedLayout([1, 8], [32 * 8 // EPI_COLS, EPI_COLS // 8], [warps, 1], [1, 0])


@gluon.jit
def my_tiles(used_tiles_ptr, n_tn):
    """(program id, programs, used row tiles, this program's count of the used_tiles x n_tn tiles)."""
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    n_used = gl.load(used_tiles_ptr)
    return pid, nprog, n_used, gl.cdiv(n_used * n_tn - pid, nprog)


@gluon.jit
def stage_barriers(STAGES: gl.constexpr, READY_COUNT: gl.constexpr, EMPTY_COUNT: gl.constexpr = 1):
    """(ready, empty): one pair of barriers per stage; ready counts READY_COUNT arrivals, empty EMPTY_COUNT (one
    per partition that reads the stages)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=READY_COUNT)
        mbarrier.init(empty.index(s), count=EMPTY_COUNT)
    return ready, empty


@gluon.jit
def one_barrier():
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    return bar


@gluon.jit
def mma_steps(acc, c0, n_k, a_bufs, b_bufs, ready, empty, fence, A_KM: gl.constexpr = False):
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
def tile_start(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr):
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
def tile_of(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr):
    """tile_start and the tile's row end (its expert's end): (expert, first row, row end, column tile)."""
    e, row0, pid_n = tile_start(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr)
    return e, row0, gl.load(expert_offsets_ptr + e + 1), pid_n


def descriptor(t, box):
    """A TMA descriptor of 2D t with the given box, in the swizzled shared layout wgmma reads."""
    return TensorDescriptor.from_tensor(t, box, _smem_layout(tuple(box), t.dtype))


@functools.cache
def stand_in(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A BLOCK_M x 128 tensor for a descriptor argument a launch never uses (32 KB per device and dtype)."""
    return torch.zeros(BLOCK_M, 128, device=device, dtype=dtype)


@functools.cache
def _smem_layout(box: tuple, dtype: torch.dtype):
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv,
           torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), gdt)


@gluon.jit
def store_tile(acc, c_smem, c_desc, c_ptr, stride_cl, row0, row_end, col0, N, PENDING: gl.constexpr = 0):
    """The MMA partition's own store of a finished tile, through c_smem: one TMA store where the tile lies within
    its rows (row0 + BLOCK_M <= row_end), else masked pieces (store_pieces), which hold few registers beside
    what else is live (the fp8 GEMM's other half). c_smem is written only once all but the PENDING newest TMA
    stores have read their tiles (0: the previous tile's store; store_ring's other buffers may stay in flight).
    Returns whether the tile went by TMA."""
    BLOCK_M: gl.constexpr = c_smem.type.shape[0]
    tma.store_wait(PENDING)  # stores complete in order
    thread_barrier()  # every thread sees those stores done before it overwrites c_smem
    c_smem.store(acc.to(c_smem.dtype))
    fence_async_shared()
    thread_barrier()  # the whole tile is in c_smem before the TMA store (or the pieces) read it
    whole = row0 + BLOCK_M <= row_end
    if whole:
        tma_store(c_desc, [row0, col0], c_smem)
    else:
        store_pieces(c_smem, c_ptr, stride_cl, row0, row_end, col0, N)
    return whole


@gluon.jit
def store_direct(acc, c_ptr, stride_cl, row0, row_end, col0, N):
    """A finished tile straight from the MMA registers to C[row0:row_end, col0:N] (rows and columns past them
    masked), no shared memory: each thread stores its accumulator pairs (a quad of threads 32 contiguous bytes of a
    float32 row). For a float32 C, whose staging tile (128 KB at 128 x 256) would not fit beside the stages."""
    BLOCK_M: gl.constexpr = acc.shape[0]
    BLOCK_N: gl.constexpr = acc.shape[1]
    layout: gl.constexpr = acc.type.layout
    offs_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_n = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    ptrs = c_ptr + offs_m.to(gl.int64)[:, None] * stride_cl + offs_n[None, :]
    gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < row_end)[:, None] & (offs_n < N)[None, :])


@gluon.jit
def store_ring(acc, c_bufs, n_st, c_desc, c_ptr, stride_cl, row0, row_end, col0, N):
    """store_tile through a ring of c_bufs.shape[0] buffers, so that a tile's store does not wait for the one before
    it: each TMA store takes the next buffer and is waited for only when that buffer comes round again; a partial
    tile's masked pieces read their buffer at once and take none. n_st: the TMA stores so far; returns it, moved on."""
    NB: gl.constexpr = c_bufs.type.shape[0]
    if store_tile(acc, c_bufs.index(n_st % NB), c_desc, c_ptr, stride_cl, row0, row_end, col0, N, NB - 1):
        n_st += 1
    return n_st


@gluon.jit
def store_pieces(c_smem, c_ptr, stride_cl, row0, row_end, col0, N):
    """c_smem to C[row0:row_end, col0:N] (rows and columns past them masked), in EPI_ROWS x EPI_COLS pieces
    with coalesced 16-byte stores."""
    BLOCK_M: gl.constexpr = c_smem.type.shape[0]
    BLOCK_N: gl.constexpr = c_smem.type.shape[1]
    layout: gl.constexpr = epilogue_layout(gl.num_warps())
    offs_m = gl.arange(0, EPI_ROWS, layout=gl.SliceLayout(1, layout))
    offs_n = gl.arange(0, EPI_COLS, layout=gl.SliceLayout(0, layout))
    for rh in gl.static_range(BLOCK_M // EPI_ROWS):
        rows = row0 + rh * EPI_ROWS + offs_m
        for ch in gl.static_range(BLOCK_N // EPI_COLS):
            piece = c_smem.slice(rh * EPI_ROWS, EPI_ROWS, dim=0).slice(ch * EPI_COLS, EPI_COLS, dim=1)
            cols = col0 + ch * EPI_COLS + offs_n
            gl.store(c_ptr + rows.to(gl.int64)[:, None] * stride_cl + cols[None, :], piece.load(layout),
                     mask=(rows < row_end)[:, None] & (cols < N)[None, :])
