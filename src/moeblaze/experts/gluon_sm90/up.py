"""The SwiGLU up-projection on Hopper: H (rows, 2h) = x[token[rows]] @ W1[e]ᵀ and A = SiLU(gate) * up, for
every expert's contiguous rows, in one persistent launch.

Partitions: 8 MMA warps (mma_handoff), a 2-warp gathering loader, a 2-warp epilogue that stores H and A
while the MMA warps go on with the next tile. A stage holds 128 gate rows of W1 and the 128 matching up rows,
so one 128x256 MMA computes both halves. The stored H is what backward reads, and A is computed from it.

Memory contract: nothing beyond H and A (either may be skipped: backward's recompute stores H alone), and
the 32 KB stand-in of common.stand_in where H is not stored by TMA. Shared memory: 3 stages of
(128 + 256) x 64 operands and one 128 x 256 tile of the accumulator in the io dtype.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ...launch import launch, sm_count, tma_ok
from ..schedule import BLOCK_M
from .common import (EPI_COLS, EPI_ROWS, descriptor, epilogue_layout, my_tiles, one_barrier, stage_barriers, stand_in,
                     tile_of, tma_store)
from .partitions import EPI_WARPS, gather_loader, mma_handoff

# 8 MMA warps + 2 loader warps + 2 epilogue warps = 12: at 168 registers each on average, the MMA warps can
# have 200 (wgmma with a 128-register accumulator needs ~154 to compile); the loader and epilogue share one
# warpgroup and so one register count (a 14th warp would leave the MMA warps fewer than ~154 registers)
UP_LOADER_WARPS = gl.constexpr(2)


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
    layout: gl.constexpr = epilogue_layout(gl.num_warps())
    n_tn = gl.cdiv(H, HALF)
    pid, nprog, n_used, n_mine = my_tiles(used_tiles_ptr, n_tn)
    offs_m = gl.arange(0, EPI_ROWS, layout=gl.SliceLayout(1, layout))
    offs_n = gl.arange(0, EPI_COLS, layout=gl.SliceLayout(0, layout))
    for j in range(n_mine):
        e, row0, row_end, pid_n = tile_of(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr,
                                           expert_offsets_ptr)
        mbarrier.wait(acc_ready.index(0), j & 1)
        # TMA_PREACT (only with STORE_PREACT): H's halves by TMA for a tile within H's rows and columns
        by_tma = (row0 + BLOCK_M <= row_end) & ((pid_n + 1) * HALF <= H) & TMA_PREACT
        if by_tma:
            tma_store(h_desc, [row0, pid_n * HALF], c_smem.slice(0, HALF, dim=1))
            tma_store(h_desc, [row0, H + pid_n * HALF], c_smem.slice(HALF, HALF, dim=1))
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
def up_swiglu_kernel(x_ptr, stride_xl, token_ptr, n_rows, w_desc, w_up_desc, h_desc, preact_ptr, act_ptr, stride_pl,
                        stride_al, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, expert_offsets_ptr, H, K_DIM,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                        STORE_PREACT: gl.constexpr, STORE_ACT: gl.constexpr, TMA_PREACT: gl.constexpr,
                        WORKER_REGS: gl.constexpr, W_PARTS: gl.constexpr):
    """H = x[token[rows]] @ W1[e]ᵀ (gate and up), A = SiLU(gate) * up; three partitions: the 8-warp MMA
    partition (default), a 2-warp gathering loader, a 2-warp epilogue."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], w_desc.dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], w_desc.dtype)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], w_desc.dtype)
    a_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_layout)
    c_smem = gl.allocate_shared_memory(w_desc.dtype, [BLOCK_M, BLOCK_N], c_layout)
    ready, empty = stage_barriers(STAGES, 32 * UP_LOADER_WARPS + 1)
    acc_ready, acc_empty = one_barrier(), one_barrier()
    mma_args = (c_smem, acc_ready, acc_empty, a_bufs, b_bufs, ready, empty, used_tiles_ptr, gl.cdiv(H, BLOCK_N // 2),
                K_DIM, True)
    loader_args = (x_ptr, stride_xl, token_ptr, n_rows, w_desc, w_up_desc, a_bufs, b_bufs, ready, empty,
                   tile_expert_ptr, tile_row_ptr, used_tiles_ptr, H, K_DIM, W_PARTS)
    epi_args = (c_smem, acc_ready, acc_empty, h_desc, preact_ptr, act_ptr, stride_pl, stride_al, tile_expert_ptr,
                tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, H, STORE_PREACT, STORE_ACT, TMA_PREACT)
    gl.warp_specialize([(mma_handoff, mma_args), (gather_loader, loader_args), (_up_epilogue, epi_args)],
                       [UP_LOADER_WARPS, EPI_WARPS], [WORKER_REGS, WORKER_REGS])


def up_swiglu(x, w1, token, offsets, sched, *, w1_up=None, preact=None, act=None, store_preact: bool = True,
              store_act: bool = True, block_k: int = 64, stages: int = 3, worker_regs: int = 112):
    """The SwiGLU up-projection: H (rows, 2h) = x[token[rows]] @ W1[e]ᵀ and A (rows, h) = SiLU(H[:, :h]) *
    H[:, h:], for each expert's contiguous rows; x (L, d), w1 (E, 2h, d) bf16/fp16 contiguous, d a
    multiple of block_k, or w1 the gate rows (E, h, d) and w1_up the up rows (E, h, d), each read in place.
    Returns (H or None, A or None): H if store_preact, A if store_act (backward's recompute stores H alone).
    The dispatcher (experts.dispatch) checks the operands; the launcher does not."""
    E, F, d = w1.shape
    h = F if w1_up is not None else F // 2
    two_h = 2 * h
    block_n = 256  # 128 gate columns and the matching 128 up columns
    w_desc = descriptor(w1.reshape(E * F, d), [block_n // 2, block_k])
    w_up_desc = w_desc if w1_up is None else descriptor(w1_up.reshape(E * h, d), [block_n // 2, block_k])
    rows = token.shape[0]
    if not (store_preact or store_act):
        raise ValueError("up_swiglu stores H, A or both")
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
    h_desc = descriptor(preact if tma_preact else stand_in(x.device, x.dtype), [BLOCK_M, block_n // 2])
    # 12 warps x 168 registers fill the register file: the loader and epilogue warpgroup gets
    # worker_regs, the MMA warps the rest
    grid = (sm_count(x.device),)
    launch(up_swiglu_kernel, grid, x, x.stride(0), token, rows, w_desc, w_up_desc, h_desc, p, a, p.stride(0),
           a.stride(0), sched[0], sched[1], sched[2], offsets, h, d, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
           STAGES=stages, STORE_PREACT=store_preact, STORE_ACT=store_act, TMA_PREACT=tma_preact,
           WORKER_REGS=worker_regs, W_PARTS=w1_up is not None, num_warps=8, maxnreg=168)
    return (preact if store_preact else None), (act if store_act else None)
