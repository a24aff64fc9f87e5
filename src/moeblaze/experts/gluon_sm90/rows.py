"""The row GEMMs on Hopper: C[rows] = A[rows] @ W[e]ᵀ (the down-projection; dX̃ = dH @ W1[e] with W stored
(K, N)), and the gathering one, C[rows] = x[token[rows]] @ W[e] with W (E, K, N) (dA' = dy[token] @ W2[e]).

rows_gemm: 8 MMA warps hand each 128x256 tile to a 2-warp store partition and go on with the next; a 1-warp TMA
loader. gathered_rows_gemm: 8 MMA warps that store their own tiles behind a gathering loader of a whole warpgroup.

Memory contract: nothing beyond C. Shared memory: 3 stages of (128 + 256) x 64 operands and one 128 x 256
tile of the accumulator in the io dtype.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...launch import launch, sm_count
from ..schedule import BLOCK_M
from .common import GATHER_WARPS, descriptor, one_barrier, stage_barriers
from .partitions import (EPI_WARPS, gather_loader, mma_handoff, mma_store, store_partition, tma_loader,
                         tma_loader_parts)


@gluon.jit
def rows_gemm_kernel(a_desc, b_desc, b_up_desc, c_desc, c_ptr, tile_expert_ptr, tile_row_ptr, used_tiles_ptr,
                     expert_offsets_ptr, N, K_DIM, SPLIT_K, stride_cl, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_K: gl.constexpr, STAGES: gl.constexpr, WORKER_REGS: gl.constexpr, B_KN: gl.constexpr,
                     W_PARTS: gl.constexpr):
    """C[rows] = A[rows] @ B[e]ᵀ with 128x256 tiles: the 8-warp MMA partition hands each accumulator to a
    2-warp store partition through shared memory and goes on with the next tile; a 1-warp TMA loader.
    B_KN: B[e] is (K, N) with N contiguous (W1 for dX̃ = dH @ W1[e]), else (N, K) (W2 for the down-projection).
    W_PARTS: B[e]'s first SPLIT_K rows from b_desc, the rest from b_up_desc (tma_loader_parts)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    if B_KN:
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    else:
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    c_smem = gl.allocate_shared_memory(a_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    ready, empty = stage_barriers(STAGES, 1)
    acc_ready, acc_empty = one_barrier(), one_barrier()
    mma_args = (c_smem, acc_ready, acc_empty, a_bufs, b_bufs, ready, empty, used_tiles_ptr, gl.cdiv(N, BLOCK_N), K_DIM,
                False)
    epi_args = (c_smem, acc_ready, acc_empty, c_desc, c_ptr, stride_cl, tile_expert_ptr, tile_row_ptr,
                expert_offsets_ptr, used_tiles_ptr, N)
    if W_PARTS:
        loader_args = (a_desc, b_desc, b_up_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr,
                       used_tiles_ptr, N, K_DIM, SPLIT_K)
        gl.warp_specialize([(mma_handoff, mma_args), (tma_loader_parts, loader_args), (store_partition, epi_args)],
                           [1, EPI_WARPS], [WORKER_REGS, WORKER_REGS])
    else:
        loader_args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, N,
                       K_DIM)
        gl.warp_specialize([(mma_handoff, mma_args), (tma_loader, loader_args), (store_partition, epi_args)],
                           [1, EPI_WARPS], [WORKER_REGS, WORKER_REGS])


@gluon.jit
def gathered_rows_gemm_kernel(x_ptr, stride_xl, token_ptr, n_rows, b_desc, c_desc, c_ptr, stride_cl, tile_expert_ptr,
                            tile_row_ptr, used_tiles_ptr, expert_offsets_ptr, N, K_DIM, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                            WORKER_REGS: gl.constexpr):
    """C[rows] = x[token[rows]] @ W[e], W (E·K, N): 8 MMA warps that store their own tiles, behind a gathering
    loader of a whole warpgroup."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], b_desc.dtype)
    a_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    c_smem = gl.allocate_shared_memory(b_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    ready, empty = stage_barriers(STAGES, 32 * GATHER_WARPS + 1)
    mma_args = (c_smem, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr,
                expert_offsets_ptr, used_tiles_ptr, N, K_DIM)
    loader_args = (x_ptr, stride_xl, token_ptr, n_rows, b_desc, b_desc, a_bufs, b_bufs, ready, empty,
                   tile_expert_ptr, tile_row_ptr, used_tiles_ptr, N, K_DIM, False)
    gl.warp_specialize([(mma_store, mma_args), (gather_loader, loader_args)], [GATHER_WARPS], [WORKER_REGS])


def gathered_rows_gemm(x, w, token, offsets, sched, out=None, *, block_k: int = 64, stages: int = 3,
                       worker_regs: int = 56):
    """C (rows, N) = x[token[rows]] @ W[e] for each expert's contiguous rows (dA' = dy[token] @ W2[e]); x (L, K)
    and w (E, K, N) bf16/fp16 contiguous, K a multiple of block_k, N of 8; token (rows,) int32.
    The dispatcher (experts.dispatch) checks these; the launcher does not."""
    E, K, N = w.shape
    c = x.new_empty(token.shape[0], N) if out is None else out
    block_n = 256
    b_desc = descriptor(w.reshape(E * K, N), [block_k, block_n])
    c_desc = descriptor(c, [BLOCK_M, block_n])
    grid = (sm_count(x.device),)
    launch(gathered_rows_gemm_kernel, grid, x, x.stride(0), token, token.shape[0], b_desc, c_desc, c, c.stride(0),
           sched[0], sched[1], sched[2], offsets, N, K, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
           STAGES=stages, WORKER_REGS=worker_regs, num_warps=8, maxnreg=168)
    return c


def rows_gemm(a, w, offsets, sched, out=None, kn: bool = False, *, w_up=None, block_k: int = 64, stages: int = 3,
              worker_regs: int = 112):
    """C (rows, N) = A[rows] @ W[e]ᵀ, w (E, N, K), or with kn = A[rows] @ W[e], w (E, K, N), for each expert's
    contiguous rows; bf16/fp16, contiguous, K and N multiples of 8 (16-byte TMA rows). 128x256 tiles whose
    stores run in their own partition beside the next tile's MMAs. w_up (kn only): W[e]'s last rows apart, W[e] =
    [w[e]; w_up[e]] read in place (dX~ = dH @ [W1 gate; W1 up][e]), w's rows a multiple of block_k. The dispatcher
    (experts.dispatch) checks these; the launcher does not."""
    E, K, N = w.shape if kn else (w.shape[0], w.shape[2], w.shape[1])
    split = 0
    if w_up is not None:
        split, K = K, K + w_up.shape[1]
    c = a.new_empty(a.shape[0], N) if out is None else out
    block_n = 256
    box = [block_k, block_n] if kn else [block_n, block_k]
    a_desc = descriptor(a, [BLOCK_M, block_k])
    b_desc = descriptor(w.reshape(-1, w.shape[2]), box)
    b_up_desc = b_desc if w_up is None else descriptor(w_up.reshape(-1, w_up.shape[2]), box)
    c_desc = descriptor(c, [BLOCK_M, block_n])
    grid = (sm_count(a.device),)
    launch(rows_gemm_kernel, grid, a_desc, b_desc, b_up_desc, c_desc, c, sched[0], sched[1], sched[2], offsets, N, K,
           split, c.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
           WORKER_REGS=worker_regs, B_KN=kn, W_PARTS=w_up is not None, num_warps=8, maxnreg=168)
    return c
