"""The weight gradients on Hopper: dW[e] (M, N) = P[rows of e]ᵀ Q[rows of e] for every expert, one side
gathered through the routing index (dW2 = dy[token]ᵀ (s·A), dW1 = dHᵀ x[token]), in one persistent launch.

The reduction runs over the expert's rows, so the gathered side needs new token ids every stage: the loader
(a whole warpgroup: TMA for the dense side, cp.async for the gathered one) reads the next stage's ids while
it issues this stage's copies; a stage is 64 rows of both sides, the gathered side's rows past the expert's
end zero-filled. 8 MMA warps store their own tiles. Experts without rows get zeros.

dW in the operands' dtype goes out through a 128 x 256 staging tile and TMA; a float32 dW (master weights' gradients)
straight from the MMA registers (store_direct), since its staging tile would not fit.

Memory contract: nothing beyond dW. Shared memory: 3 stages of 64 x (128 + 256) operands and one 128 x 256
tile of the accumulator in the io dtype (none for a float32 dW).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait

from ...launch import cdiv, launch, sm_count
from .common import (GATHER_WARPS, cp_async, descriptor, gather_layout, mma_layout, mma_steps, stage_barriers,
                     store_direct, store_tile, tma_load)

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
    other where that one wins, the grouped order 6-8% faster for dW2 at B and 3-4% for dW1 at E (H200)."""
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
    layout: gl.constexpr = gather_layout(64, gl.num_warps())
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    n_mine = gl.cdiv(n_tiles - pid, nprog)
    offs_r = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    offs_c = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    if n_mine > 0:
        e, tm, tn = _wgrad_tile(0, pid, nprog, n_tm, n_tn, group)
        start, end = gl.load(expert_offsets_ptr + e), gl.load(expert_offsets_ptr + e + 1)
        tok = gl.load(token_ptr + start + offs_r, mask=start + offs_r < end, other=0)
        # the next tile (the last one again past the end: read, never used); its row range loaded a tile
        # earlier still, so no stage waits on that load
        e1, tm1, tn1 = _wgrad_tile(gl.minimum(1, n_mine - 1), pid, nprog, n_tm, n_tn, group)
        start1, end1 = gl.load(expert_offsets_ptr + e1), gl.load(expert_offsets_ptr + e1 + 1)
        c = 0
        for j in range(n_mine):
            e2, tm2, tn2 = _wgrad_tile(gl.minimum(j + 2, n_mine - 1), pid, nprog, n_tm, n_tn, group)
            start2, end2 = gl.load(expert_offsets_ptr + e2), gl.load(expert_offsets_ptr + e2 + 1)
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
                    tma_load(dense_desc, [row, dense_col], ready.index(s), q_bufs.index(s))
                    cp_async(p_bufs.index(s), ptrs, mask=rmask)
                else:
                    tma_load(dense_desc, [row, dense_col], ready.index(s), p_bufs.index(s))
                    cp_async(q_bufs.index(s), ptrs, mask=rmask)
                async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
                tok = tok1
                c += 1
            if n_k == 0:  # an expert without rows: nothing read ahead
                tok = gl.load(token_ptr + start1 + offs_r, mask=start1 + offs_r < end1, other=0)
            e, tm, tn, start, end = e1, tm1, tn1, start1, end1
            e1, tm1, tn1, start1, end1 = e2, tm2, tn2, start2, end2


@gluon.jit
def _wgrad_mma_store(c_smem, c_desc, c_ptr, stride_cl, p_bufs, q_bufs, ready, empty, expert_offsets_ptr, n_tiles,
                     n_tm, n_tn, group, M, N):
    """The MMA partition storing dW whole (_wgrad_mma)."""
    _wgrad_mma(c_smem, c_desc, c_ptr, stride_cl, c_desc, c_ptr, p_bufs, q_bufs, ready, empty, expert_offsets_ptr,
               n_tiles, n_tm, n_tn, group, M, N, M, False)


@gluon.jit
def _wgrad_mma_store_parts(c_smem, c_desc, c_ptr, stride_cl, c_up_desc, c_up_ptr, p_bufs, q_bufs, ready, empty,
                           expert_offsets_ptr, n_tiles, n_tm, n_tn, group, M, N, SPLIT_M):
    """The MMA partition storing dW in two parts (_wgrad_mma). Two partitions, not one with a flag: an argument of
    warp_specialize reaches its partition as a runtime value, constexpr or not, and the stores behind a runtime
    branch fail triton 3.6's lowering to LLVM."""
    _wgrad_mma(c_smem, c_desc, c_ptr, stride_cl, c_up_desc, c_up_ptr, p_bufs, q_bufs, ready, empty,
               expert_offsets_ptr, n_tiles, n_tm, n_tn, group, M, N, SPLIT_M, True)


@gluon.jit
def _wgrad_store(acc, c_smem, c_desc, c_ptr, stride_cl, row0, row_end, col0, N):
    """A finished dW tile: through c_smem and TMA (store_tile) in the operands' dtype, from the registers
    (store_direct) in float32 (the pointer's type decides as the kernel is compiled)."""
    if c_ptr.dtype.element_ty == gl.float32:
        store_direct(acc, c_ptr, stride_cl, row0, row_end, col0, N)
    else:
        store_tile(acc, c_smem, c_desc, c_ptr, stride_cl, row0, row_end, col0, N)


@gluon.jit
def _wgrad_mma(c_smem, c_desc, c_ptr, stride_cl, c_up_desc, c_up_ptr, p_bufs, q_bufs, ready, empty, expert_offsets_ptr,
               n_tiles, n_tm, n_tn, group, M, N, SPLIT_M, C_PARTS: gl.constexpr):
    """Each dW tile: Pᵀ (P's stages read transposed) times Q over the expert's rows, then stored by these warps
    (store_tile, keeping to the expert's M rows). An expert without rows stores zeros. C_PARTS: dW[e]'s first
    SPLIT_M rows go to c (E·SPLIT_M, N), the rest to c_up (dW1's gate and up rows, each in its own tensor);
    SPLIT_M a multiple of BLOCK_M, so that every tile lies in one part."""
    S: gl.constexpr = p_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = p_bufs.type.shape[1]
    BLOCK_M: gl.constexpr = p_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = q_bufs.type.shape[2]
    acc_layout: gl.constexpr = mma_layout(8, BLOCK_N)
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    n_mine = gl.cdiv(n_tiles - pid, nprog)
    c0 = 0
    # each tile's row range is loaded a tile ahead: loaded where the tile starts, a global load's latency
    # stands between two tiles' MMAs (a program without tiles reads none: its first tile lies past the experts)
    if n_mine > 0:
        e, tm, tn = _wgrad_tile(0, pid, nprog, n_tm, n_tn, group)
        start, end = gl.load(expert_offsets_ptr + e), gl.load(expert_offsets_ptr + e + 1)
        for j in range(n_mine):
            e1, tm1, tn1 = _wgrad_tile(gl.minimum(j + 1, n_mine - 1), pid, nprog, n_tm, n_tn, group)
            start1, end1 = gl.load(expert_offsets_ptr + e1), gl.load(expert_offsets_ptr + e1 + 1)
            n_k = gl.cdiv(end - start, BLOCK_K)
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            acc = mma_steps(acc, c0, n_k, p_bufs, q_bufs, ready, empty, True, A_KM=True)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty.index((c0 + n_k + S - 1) % S), pred=n_k > 0)
            c0 += n_k
            if C_PARTS:
                if tm * BLOCK_M < SPLIT_M:
                    _wgrad_store(acc, c_smem, c_desc, c_ptr, stride_cl, e * SPLIT_M + tm * BLOCK_M, (e + 1) * SPLIT_M,
                                 tn * BLOCK_N, N)
                else:
                    M_UP = M - SPLIT_M
                    _wgrad_store(acc, c_smem, c_up_desc, c_up_ptr, stride_cl, e * M_UP + tm * BLOCK_M - SPLIT_M,
                                 (e + 1) * M_UP, tn * BLOCK_N, N)
            else:
                _wgrad_store(acc, c_smem, c_desc, c_ptr, stride_cl, e * M + tm * BLOCK_M, e * M + M, tn * BLOCK_N, N)
            e, tm, tn, start, end = e1, tm1, tn1, start1, end1
    tma.store_wait(0)


@gluon.jit
def weight_grad_kernel(dense_desc, src_ptr, stride_src, token_ptr, c_desc, c_ptr, stride_cl, c_up_desc, c_up_ptr,
                       expert_offsets_ptr, E, M, N, SPLIT_M, GROUP, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_K: gl.constexpr, STAGES: gl.constexpr, WORKER_REGS: gl.constexpr,
                       C_PARTS: gl.constexpr):
    """dW[e] (M, N) = P[rows of e]ᵀ Q[rows of e] for every expert: 8 MMA warps that store their own tiles, and a
    loader of a whole warpgroup (TMA for the dense side, cp.async for the gathered one; which is which, the
    dense side's box tells). C_PARTS: dW's rows in two tensors (_wgrad_mma_store_parts)."""
    dtype: gl.constexpr = dense_desc.dtype
    p_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_M],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_M], dtype))
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype))
    if c_ptr.dtype.element_ty == gl.float32:  # stored from registers (_wgrad_store): a stand-in, never written
        c_smem = gl.allocate_shared_memory(dtype, [8, BLOCK_N], gl.NVMMASharedLayout.get_default_for([8, BLOCK_N],
                                                                                                     dtype))
    else:
        c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    ready, empty = stage_barriers(STAGES, 32 * GATHER_WARPS + 1)
    n_tm, n_tn = gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N)
    n_tiles = E * n_tm * n_tn
    loader_args = (dense_desc, src_ptr, stride_src, token_ptr, p_bufs, q_bufs, ready, empty, expert_offsets_ptr,
                   n_tiles, n_tm, n_tn, GROUP)
    if C_PARTS:
        mma_args = (c_smem, c_desc, c_ptr, stride_cl, c_up_desc, c_up_ptr, p_bufs, q_bufs, ready, empty,
                    expert_offsets_ptr, n_tiles, n_tm, n_tn, GROUP, M, N, SPLIT_M)
        gl.warp_specialize([(_wgrad_mma_store_parts, mma_args), (_wgrad_loader, loader_args)], [GATHER_WARPS],
                           [WORKER_REGS])
    else:
        mma_args = (c_smem, c_desc, c_ptr, stride_cl, p_bufs, q_bufs, ready, empty, expert_offsets_ptr, n_tiles, n_tm,
                    n_tn, GROUP, M, N)
        gl.warp_specialize([(_wgrad_mma_store, mma_args), (_wgrad_loader, loader_args)], [GATHER_WARPS],
                           [WORKER_REGS])


def weight_grad(p, q, token, offsets, out, gather_p: bool, *, out_up=None, block_k: int = 64, stages: int = 3,
                worker_regs: int = 56):
    """out[e] (M, N) = P[rows of e]ᵀ Q[rows of e] for each expert's contiguous rows (offsets (E+1,) int32), with
    P = p[token[rows]], Q = q[rows] if gather_p, else P = p[rows], Q = q[token[rows]]; token (rows,) int32.
    bf16/fp16, contiguous, out in the operands' dtype or float32; the gathered side's width a multiple of its block
    (WGRAD_BLOCKS: 128 for P, 256 for Q), the dense side's and N multiples of 8 (16-byte TMA rows). out_up: dW[e]'s
    last rows apart, dW[e] = [out[e]; out_up[e]] (dW1 as gate and up rows), out's rows a multiple of WGRAD_BLOCKS[0].
    The dispatcher (experts.dispatch) checks these; the launcher does not. Returns out."""
    E, M, N = out.shape
    split = 0
    if out_up is not None:
        split, M = M, M + out_up.shape[1]
    block_m, block_n = WGRAD_BLOCKS
    dense, src = (q, p) if gather_p else (p, q)
    dense_desc = descriptor(dense, [block_k, block_n if gather_p else block_m])
    c2d = out.view(-1, N)
    c_desc = descriptor(c2d, [block_m, block_n])
    c_up = c2d if out_up is None else out_up.view(-1, N)
    c_up_desc = c_desc if out_up is None else descriptor(c_up, [block_m, block_n])
    grid = (sm_count(p.device),)
    group = wgrad_group(cdiv(M, block_m), cdiv(N, block_n))
    launch(weight_grad_kernel, grid, dense_desc, src, src.stride(0), token, c_desc, c2d, c2d.stride(0), c_up_desc, c_up,
           offsets, E, M, N, split, group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
           WORKER_REGS=worker_regs, C_PARTS=out_up is not None, num_warps=8, maxnreg=168)
    return out
