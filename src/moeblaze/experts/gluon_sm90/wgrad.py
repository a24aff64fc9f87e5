"""The weight gradients on Hopper: dW[e] (M, N) = P[rows of e]ᵀ Q[rows of e] for every expert, one side
gathered through the routing index (dW2 = dy[token]ᵀ (s·A), dW1 = dHᵀ x[token]), in one persistent launch.

The reduction runs over the expert's rows, so the gathered side needs new token ids every stage: the loader
(a whole warpgroup: TMA for the dense side, cp.async for the gathered one) reads the next stage's ids while
it issues this stage's copies; a stage is 64 rows of both sides, the gathered side's rows past the expert's
end zero-filled. 8 MMA warps store their own tiles. Experts without rows get zeros.

Memory contract: nothing beyond dW. Shared memory: 3 stages of 64 x (128 + 256) operands and one 128 x 256
tile of the accumulator in the io dtype.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait

from ...launch import launch, sm_count
from .common import (GATHER_WARPS, cp_async, descriptor, gather_layout, mma_layout, mma_steps, stage_barriers,
                     store_tile, tma_load)

# ---- weight gradients: dW[e] = P[rows of e]ᵀ Q[rows of e], one side gathered ------------------------------
# the reduction runs over the expert's rows, so the gathered side needs new token ids every stage: the
# loader reads the next stage's ids while it issues this stage's copies
WGRAD_BLOCKS = (128, 256)  # (BLOCK_M: P's columns per tile of dW, BLOCK_N: Q's columns)
PINGPONG_BLOCKS = (128, 128)  # a tile per MMA warpgroup (weight_grad_pingpong_kernel)
PINGPONG_STAGES = 4


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
    (benchmarks/results/nvidia-h200-wgrad-order.log)."""
    return 1 if n_tm >= 2 * n_tn else 16


@gluon.jit
def _wgrad_loader(dense_desc, src_ptr, stride_src, token_ptr, dense_bufs, gathered_bufs, ready, empty,
                  expert_offsets_ptr, n_tiles, n_tm, n_tn, group, gather_p):
    """Stages of BLOCK_K rows of P (BLOCK_K x BLOCK_M) and Q (BLOCK_K x BLOCK_N): the dense side through TMA
    (its rows past the expert's end are the next expert's, or TMA's zeros past the tensor), the gathered
    side src[token[r]] through cp.async with the rows past the expert's end zero-filled, so they add
    nothing. (A non-finite value in the next expert's dense rows would still reach this expert's sum:
    0 x inf; a step with one has no usable gradients anyway.)"""
    S: gl.constexpr = dense_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = dense_bufs.type.shape[1]
    WIDTH: gl.constexpr = gathered_bufs.type.shape[2]
    DENSE_WIDTH: gl.constexpr = dense_bufs.type.shape[2]
    layout: gl.constexpr = gather_layout(64, gl.num_warps())
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    n_mine = gl.cdiv(n_tiles - pid, nprog)
    offs_r = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    offs_c = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    if n_mine > 0:
        e, tm, tn = _wgrad_tile(0, pid, nprog, n_tm, n_tn, group)
        start, end = gl.load(expert_offsets_ptr + e), gl.load(expert_offsets_ptr + e + 1)
        # token ids two stages ahead of the stage being issued (a cursor over this program's stages): their
        # load's latency stands between no two stages
        pj, pk, ps, pe = _next_stage(pid * 0, pid * 0 - 1, start, end, n_mine, pid, nprog, n_tm, n_tn, group, expert_offsets_ptr,
                                     BLOCK_K)
        tok = _stage_tokens(token_ptr, ps + pk * BLOCK_K, pe, offs_r)
        pj, pk, ps, pe = _next_stage(pj, pk, ps, pe, n_mine, pid, nprog, n_tm, n_tn, group, expert_offsets_ptr,
                                     BLOCK_K)
        tok1 = _stage_tokens(token_ptr, ps + pk * BLOCK_K, pe, offs_r)
        # the next tile (the last one again past the end: read, never used); its row range loaded a tile
        # earlier still, so no stage waits on that load
        e1, tm1, tn1 = _wgrad_tile(gl.minimum(1, n_mine - 1), pid, nprog, n_tm, n_tn, group)
        start1, end1 = gl.load(expert_offsets_ptr + e1), gl.load(expert_offsets_ptr + e1 + 1)
        c = 0
        for j in range(n_mine):
            e2, tm2, tn2 = _wgrad_tile(gl.minimum(j + 2, n_mine - 1), pid, nprog, n_tm, n_tn, group)
            start2, end2 = gl.load(expert_offsets_ptr + e2), gl.load(expert_offsets_ptr + e2 + 1)
            if gather_p != 0:  # P gathered: its columns are the tile's rows of dW
                src_col = tm * WIDTH
                dense_col = tn * DENSE_WIDTH
            else:
                src_col = tn * WIDTH
                dense_col = tm * DENSE_WIDTH
            src_cols = src_ptr + src_col + offs_c
            n_k = gl.cdiv(end - start, BLOCK_K)
            for k in range(n_k):
                row = start + k * BLOCK_K
                pj, pk, ps, pe = _next_stage(pj, pk, ps, pe, n_mine, pid, nprog, n_tm, n_tn, group,
                                             expert_offsets_ptr, BLOCK_K)
                tok2 = _stage_tokens(token_ptr, ps + pk * BLOCK_K, pe, offs_r)
                s = c % S
                mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)  # a fresh barrier passes phase 1
                mbarrier.expect(ready.index(s), dense_desc.block_type.nbytes)
                ptrs = src_cols[None, :] + tok.to(gl.int64)[:, None] * stride_src
                rmask = (row + offs_r < end)[:, None]
                tma_load(dense_desc, [row, dense_col], ready.index(s), dense_bufs.index(s))
                cp_async(gathered_bufs.index(s), ptrs, mask=rmask)
                async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
                tok = tok1
                tok1 = tok2
                c += 1
            e, tm, tn, start, end = e1, tm1, tn1, start1, end1
            e1, tm1, tn1, start1, end1 = e2, tm2, tn2, start2, end2


@gluon.jit
def _next_stage(pj, pk, ps, pe, n_mine, pid, nprog, n_tm, n_tn, group, expert_offsets_ptr, BLOCK_K: gl.constexpr):
    """The stage after stage pk of this program's tile pj (rows ps..pe of its expert): (tile, stage, rows),
    past tiles without rows; past the last stage, stages beyond the last tile's rows (nothing to load)."""
    pk += 1
    while (pk * BLOCK_K >= pe - ps) & (pj < n_mine - 1):
        pj += 1
        pk *= 0
        e, tm, tn = _wgrad_tile(pj, pid, nprog, n_tm, n_tn, group)
        ps = gl.load(expert_offsets_ptr + e)
        pe = gl.load(expert_offsets_ptr + e + 1)
    return pj, pk, ps, pe


@gluon.jit
def _stage_tokens(token_ptr, row, end, offs_r):
    """The token ids of a stage's rows row.. (0 past end)."""
    return gl.load(token_ptr + row + offs_r, mask=row + offs_r < end, other=0)


@gluon.jit
def _loader_args(dense_desc, src_ptr, stride_src, token_ptr, p_bufs, q_bufs, ready, empty, expert_offsets_ptr,
                 n_tiles, n_tm, n_tn, group, GATHER_P: gl.constexpr):
    """_wgrad_loader's arguments: the stage buffers as dense and gathered side, and GATHER_P as a value (a
    partition takes no constexpr arguments)."""
    gather_p = gl.program_id(0) * 0 + GATHER_P
    if GATHER_P:
        return (dense_desc, src_ptr, stride_src, token_ptr, q_bufs, p_bufs, ready, empty, expert_offsets_ptr,
                n_tiles, n_tm, n_tn, group, gather_p)
    else:
        return (dense_desc, src_ptr, stride_src, token_ptr, p_bufs, q_bufs, ready, empty, expert_offsets_ptr,
                n_tiles, n_tm, n_tn, group, gather_p)


@gluon.jit
def _wgrad_mma_store(c_smem, c_desc, c_ptr, stride_cl, p_bufs, q_bufs, ready, empty, expert_offsets_ptr, n_tiles, n_tm,
                     n_tn, group, M, N):
    """Each dW tile: Pᵀ (P's stages read transposed) times Q over the expert's rows, then stored by these warps
    (store_tile, keeping to the expert's M rows). An expert without rows stores zeros."""
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
            store_tile(acc, c_smem, c_desc, c_ptr, stride_cl, e * M + tm * BLOCK_M, e * M + M, tn * BLOCK_N, N)
            e, tm, tn, start, end = e1, tm1, tn1, start1, end1
    tma.store_wait(0)


@gluon.jit
def weight_grad_kernel(dense_desc, src_ptr, stride_src, token_ptr, c_desc, c_ptr, stride_cl, expert_offsets_ptr,
                       E, M, N, GROUP, GATHER_P: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_K: gl.constexpr, STAGES: gl.constexpr, WORKER_REGS: gl.constexpr):
    """dW[e] (M, N) = P[rows of e]ᵀ Q[rows of e] for every expert: 8 MMA warps that store their own tiles, and a
    loader of a whole warpgroup (TMA for the dense side, cp.async for the gathered one; which is which, the
    dense side's box tells)."""
    dtype: gl.constexpr = dense_desc.dtype
    p_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_M],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_M], dtype))
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype))
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    ready, empty = stage_barriers(STAGES, 32 * GATHER_WARPS + 1)
    n_tm, n_tn = gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N)
    n_tiles = E * n_tm * n_tn
    mma_args = (c_smem, c_desc, c_ptr, stride_cl, p_bufs, q_bufs, ready, empty, expert_offsets_ptr, n_tiles, n_tm, n_tn,
                GROUP, M, N)
    loader_args = _loader_args(dense_desc, src_ptr, stride_src, token_ptr, p_bufs, q_bufs, ready, empty,
                               expert_offsets_ptr, n_tiles, n_tm, n_tn, GROUP, GATHER_P)
    gl.warp_specialize([(_wgrad_mma_store, mma_args), (_wgrad_loader, loader_args)], [GATHER_WARPS], [WORKER_REGS])


@gluon.jit
def _wgrad_pingpong_mma(c_smem, c_desc, c_ptr, stride_cl, p_bufs, q_bufs, ready, empty, turn, expert_offsets_ptr,
                        n_tiles, n_tm, n_tn, group, M, N, wg: gl.constexpr):
    """One of two MMA warpgroups that take this program's tiles in turn (wg 0 the even ones, wg 1 the odd): the
    stages come in tile order, so each walks the stage ring over the other's tiles too. A warpgroup issues its
    tile's MMAs only once the other has issued all of its own (the turn barriers), then drains and stores its
    tile while the other's MMAs run: the tensor cores see no tile's epilogue."""
    S: gl.constexpr = p_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = p_bufs.type.shape[1]
    BLOCK_M: gl.constexpr = p_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = q_bufs.type.shape[2]
    acc_layout: gl.constexpr = mma_layout(gl.num_warps(), BLOCK_N)
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    n_mine = gl.cdiv(n_tiles - pid, nprog)
    c0 = 0
    if n_mine > 0:
        e, tm, tn = _wgrad_tile(0, pid, nprog, n_tm, n_tn, group)
        start, end = gl.load(expert_offsets_ptr + e), gl.load(expert_offsets_ptr + e + 1)
        for j in range(n_mine):
            e1, tm1, tn1 = _wgrad_tile(gl.minimum(j + 1, n_mine - 1), pid, nprog, n_tm, n_tn, group)
            start1, end1 = gl.load(expert_offsets_ptr + e1), gl.load(expert_offsets_ptr + e1 + 1)
            n_k = gl.cdiv(end - start, BLOCK_K)
            if j % 2 == wg:
                # wg 0's first wait passes (a fresh barrier's phase 1); after that each waits for the other's turn
                mbarrier.wait(turn.index(wg), ((j // 2) & 1) ^ (1 - wg))
                acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
                acc = mma_steps(acc, c0, n_k, p_bufs, q_bufs, ready, empty, True, A_KM=True)
                mbarrier.arrive(turn.index(1 - wg))
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                mbarrier.arrive(empty.index((c0 + n_k + S - 1) % S), pred=n_k > 0)
                store_tile(acc, c_smem, c_desc, c_ptr, stride_cl, e * M + tm * BLOCK_M, e * M + M, tn * BLOCK_N, N)
            c0 += n_k
            e, tm, tn, start, end = e1, tm1, tn1, start1, end1
    tma.store_wait(0)


@gluon.jit
def _wgrad_pingpong_mma0(c_smem, c_desc, c_ptr, stride_cl, p_bufs, q_bufs, ready, empty, turn, expert_offsets_ptr,
                         n_tiles, n_tm, n_tn, group, M, N):
    _wgrad_pingpong_mma(c_smem, c_desc, c_ptr, stride_cl, p_bufs, q_bufs, ready, empty, turn, expert_offsets_ptr,
                        n_tiles, n_tm, n_tn, group, M, N, 0)


@gluon.jit
def _wgrad_pingpong_mma1(c_smem, c_desc, c_ptr, stride_cl, p_bufs, q_bufs, ready, empty, turn, expert_offsets_ptr,
                         n_tiles, n_tm, n_tn, group, M, N):
    _wgrad_pingpong_mma(c_smem, c_desc, c_ptr, stride_cl, p_bufs, q_bufs, ready, empty, turn, expert_offsets_ptr,
                        n_tiles, n_tm, n_tn, group, M, N, 1)


@gluon.jit
def weight_grad_pingpong_kernel(dense_desc, src_ptr, stride_src, token_ptr, c_desc, c_ptr, stride_cl,
                                expert_offsets_ptr, E, M, N, GROUP, GATHER_P: gl.constexpr, BLOCK_M: gl.constexpr,
                                BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                                MMA_REGS: gl.constexpr, WORKER_REGS: gl.constexpr):
    """weight_grad_kernel with two MMA warpgroups of 4 warps that each own whole tiles and take turns on the
    tensor cores (_wgrad_pingpong_mma), each with its own c_smem, and the same loader."""
    dtype: gl.constexpr = dense_desc.dtype
    p_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_M],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_M], dtype))
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype))
    c_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], c_desc.layout)
    ready, empty = stage_barriers(STAGES, 32 * GATHER_WARPS + 1)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    n_tm, n_tn = gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N)
    n_tiles = E * n_tm * n_tn
    mma_args = (c_desc, c_ptr, stride_cl, p_bufs, q_bufs, ready, empty, turn, expert_offsets_ptr, n_tiles, n_tm,
                n_tn, GROUP, M, N)
    loader_args = _loader_args(dense_desc, src_ptr, stride_src, token_ptr, p_bufs, q_bufs, ready, empty,
                               expert_offsets_ptr, n_tiles, n_tm, n_tn, GROUP, GATHER_P)
    gl.warp_specialize([(_wgrad_pingpong_mma0, (c_smem.index(0), ) + mma_args),
                        (_wgrad_pingpong_mma1, (c_smem.index(1), ) + mma_args),
                        (_wgrad_loader, loader_args)], [4, GATHER_WARPS], [MMA_REGS, WORKER_REGS])


def weight_grad(p, q, token, offsets, out, gather_p: bool, block_k: int = 64, stages: int | None = None,
                worker_regs: int = 56, pingpong: bool = False, mma_regs: int = 232):
    """out[e] (M, N) = P[rows of e]ᵀ Q[rows of e] for each expert's contiguous rows (offsets (E+1,) int32), with
    P = p[token[rows]], Q = q[rows] if gather_p, else P = p[rows], Q = q[token[rows]]; token (rows,) int32.
    bf16/fp16, contiguous, out in the operands' dtype; the gathered side's width a multiple of its block
    (WGRAD_BLOCKS: 128 for P, 256 for Q), the dense side's and N multiples of 8 (16-byte TMA rows). The dispatcher
    (experts.dispatch) checks these; the launcher does not. pingpong: weight_grad_pingpong_kernel, on
    PINGPONG_BLOCKS tiles."""
    E, M, N = out.shape
    block_m, block_n = PINGPONG_BLOCKS if pingpong else WGRAD_BLOCKS
    dense, src = (q, p) if gather_p else (p, q)
    dense_desc = descriptor(dense, [block_k, block_n if gather_p else block_m])
    c2d = out.view(E * M, N)
    c_desc = descriptor(c2d, [block_m, block_n])
    grid = (sm_count(p.device),)
    group = wgrad_group(triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    args = (dense_desc, src, src.stride(0), token, c_desc, c2d, c2d.stride(0), offsets, E, M, N, group)
    if pingpong:
        launch(weight_grad_pingpong_kernel, grid, *args, GATHER_P=gather_p, BLOCK_M=block_m, BLOCK_N=block_n,
               BLOCK_K=block_k, STAGES=stages or PINGPONG_STAGES, MMA_REGS=mma_regs, WORKER_REGS=worker_regs,
               num_warps=4, maxnreg=168)
    else:
        launch(weight_grad_kernel, grid, *args, GATHER_P=gather_p, BLOCK_M=block_m, BLOCK_N=block_n,
               BLOCK_K=block_k, STAGES=stages or 3, WORKER_REGS=worker_regs, num_warps=8, maxnreg=168)
    return out
