"""Lab notebook, 2026-11-26. Question: does the SwiGLU down-projection's backward on Hopper get faster with the
activation's backward fused into the dA' GEMM as an epilogue partition (SonicMoE's dataflow), instead of Gluon's two
passes (the gathering GEMM stores dA', then a tl pass reads dA' and H and writes dH, s·A and dS)?
Answer: not with the epilogue's memory traffic done by two warps. This kernel (a 2-warp gathering loader, 8 MMA warps
handing each dA' tile to a 2-warp epilogue through shared memory, which loads H's gate and up, stores dH and s·A and
one dS partial per row and column tile) is correct (dH apart and over H, s·A and dS within twice the error of torch's
bf16 GEMM and epilogue against fp64, for ragged and many-tile experts at h = 256, 328, 1024) but 3-8x slower than
the two passes on an H100 (torch 2.11, triton 3.6):

    config   gathered GEMM alone   two passes   fused (H loaded 0, 1 or 2 pieces ahead; 112 or 136 registers)
    B        3.14-3.43 ms          5.41-5.49    16.2-17.4
    D        1.27                  2.11-2.22    6.32-6.43
    E        1.57-1.63             2.16-2.35    4.37-4.50
    A        0.23-0.24             0.52-0.53    2.13-2.18
    C        0.31-0.33             0.54-0.55    1.67-1.72

The fused time is ~135 µs per 128 x 256 tile at every config, whatever K (d = 1024-4096): the epilogue, not the
MMAs, paces it; prefetching H changes nothing, so it is not the loads' latency but what two warps can move (320 KB
a tile through LDG/STG: ~2 GB/s per SM against the ~13 GB/s per SM the MMAs' pace needs at B). The SASS has no
spills at 8-row pieces and no slow paths (64 LDS.128, 128 LDG.128, 192 STG.128 a tile, as designed). What would
move it: the epilogue's traffic through TMA (H's chunks loaded and dH and s·A stored by the copy engine, which
needs no warps in flight; shared memory allows a 16 KB chunk beside 3 operand stages and the dA' tile: 224 KB), or
more warps on it at fewer registers, or the two passes overlapped on two streams (the act pass is HBM-bound at
2.8 TB/s, the GEMM tensor-bound).

    python benchmarks/experiments/fp8/fused_dh_gluon.py [--configs B,D,E,A,C]      (Hopper)
"""
from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from moeblaze.bench.harness import make_problem
from moeblaze.bench.names import CONFIGS
from moeblaze.experts import gluon_sm90, stages
from moeblaze.experts.gluon_sm90.common import (EPI_COLS, descriptor, epilogue_layout, my_tiles, one_barrier,
                                                stage_barriers, tile_of)
from moeblaze.experts.gluon_sm90.partitions import EPI_WARPS, gather_loader, mma_handoff
from moeblaze.experts.schedule import BLOCK_M
from moeblaze.experts.stages import RowPlan
from moeblaze.launch import cdiv, launch, sm_count
from moeblaze.routing import build_routing_index
from moeblaze.routing.index import in_row_order

LOADER_WARPS = gl.constexpr(2)  # as the up-projection's: 8 MMA warps keep ~200 registers beside 2 + 2 workers
PREFETCH = gl.constexpr(2)  # H's pieces loaded this many ahead (0, 1, 2 measured alike)
DH_ROWS = gl.constexpr(8)  # the epilogue walks a tile in 8 x 64 pieces (16-row pieces spill)


@gluon.jit
def _h_piece(preact_ptr, stride_pl, row0, row_end, col0, H, offs_m, offs_n):
    """H's gate and up values of rows row0 .. row0+DH_ROWS and pairs col0 .. col0+EPI_COLS (0 past the rows' end
    and H)."""
    rows = row0 + offs_m
    cols = col0 + offs_n
    mask = (rows < row_end)[:, None] & (cols < H)[None, :]
    ptrs = preact_ptr + rows.to(gl.int64)[:, None] * stride_pl + cols[None, :]
    return gl.load(ptrs, mask=mask, other=0.0), gl.load(ptrs + H, mask=mask, other=0.0)


@gluon.jit
def _dh_epilogue(c_smem, acc_ready, acc_empty, preact_ptr, dpreact_ptr, act_scaled_ptr, w_sorted_ptr, ds_part_ptr,
                 stride_pl, stride_dl, stride_al, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, used_tiles_ptr,
                 H, R):
    """Each tile of dA' from c_smem, in DH_ROWS x EPI_COLS pieces: H's gate and up loaded two pieces ahead (the
    first two before the tile's dA' is waited for), dH and s·A stored, and the tile's dS partial of each row into
    ds_part[column tile, row]; c_smem handed back once read. A piece's H is loaded before the stores of the pieces
    before it, which may be H itself (dpreact = preact): the pieces' elements are disjoint."""
    BLOCK_M: gl.constexpr = c_smem.type.shape[0]
    BLOCK_N: gl.constexpr = c_smem.type.shape[1]
    NCH: gl.constexpr = BLOCK_N // EPI_COLS
    NP: gl.constexpr = (BLOCK_M // DH_ROWS) * NCH
    layout: gl.constexpr = epilogue_layout(gl.num_warps())
    n_tn = gl.cdiv(H, BLOCK_N)
    pid, nprog, n_used, n_mine = my_tiles(used_tiles_ptr, n_tn)
    offs_m = gl.arange(0, DH_ROWS, layout=gl.SliceLayout(1, layout))
    offs_n = gl.arange(0, EPI_COLS, layout=gl.SliceLayout(0, layout))
    for j in range(n_mine):
        e, row0, row_end, pid_n = tile_of(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr,
                                           expert_offsets_ptr)
        col0 = pid_n * BLOCK_N
        if PREFETCH >= 1:
            g1, u1 = _h_piece(preact_ptr, stride_pl, row0, row_end, col0, H, offs_m, offs_n)
        if PREFETCH >= 2:
            g2, u2 = _h_piece(preact_ptr, stride_pl, row0, row_end, col0 + EPI_COLS, H, offs_m, offs_n)
        mbarrier.wait(acc_ready.index(0), j & 1)
        for p in gl.static_range(NP):
            if PREFETCH == 0:
                g, u = _h_piece(preact_ptr, stride_pl, row0 + (p // NCH) * DH_ROWS, row_end,
                                col0 + (p % NCH) * EPI_COLS, H, offs_m, offs_n)
            else:
                g, u = g1, u1
            if PREFETCH == 1:
                if p + 1 < NP:
                    g1, u1 = _h_piece(preact_ptr, stride_pl, row0 + ((p + 1) // NCH) * DH_ROWS, row_end,
                                      col0 + ((p + 1) % NCH) * EPI_COLS, H, offs_m, offs_n)
            if PREFETCH == 2:
                g1, u1 = g2, u2
                if p + 2 < NP:
                    g2, u2 = _h_piece(preact_ptr, stride_pl, row0 + ((p + 2) // NCH) * DH_ROWS, row_end,
                                      col0 + ((p + 2) % NCH) * EPI_COLS, H, offs_m, offs_n)
            g, u = g.to(gl.float32), u.to(gl.float32)
            rows = row0 + (p // NCH) * DH_ROWS + offs_m
            rmask = rows < row_end
            if p % NCH == 0:
                s = gl.load(w_sorted_ptr + rows, mask=rmask, other=0.0)
                ds = gl.zeros([DH_ROWS], gl.float32, gl.SliceLayout(1, layout))
            cols = col0 + (p % NCH) * EPI_COLS + offs_n
            mask = rmask[:, None] & (cols < H)[None, :]
            da = c_smem.slice((p // NCH) * DH_ROWS, DH_ROWS, dim=0).slice((p % NCH) * EPI_COLS, EPI_COLS, dim=1)
            da = da.load(layout).to(gl.float32)
            sg = 1.0 / (1.0 + gl.exp(-g))
            act_g = g * sg
            a = act_g * u
            das = da * s[:, None]
            d_ptrs = dpreact_ptr + rows.to(gl.int64)[:, None] * stride_dl + cols[None, :]
            gl.store(d_ptrs, (das * u * (sg * (1.0 + g * (1.0 - sg)))).to(dpreact_ptr.dtype.element_ty), mask=mask)
            gl.store(d_ptrs + H, (das * act_g).to(dpreact_ptr.dtype.element_ty), mask=mask)
            a_ptrs = act_scaled_ptr + rows.to(gl.int64)[:, None] * stride_al + cols[None, :]
            gl.store(a_ptrs, (a * s[:, None]).to(act_scaled_ptr.dtype.element_ty), mask=mask)
            ds += gl.sum(da * a, axis=1)
            if p % NCH == NCH - 1:
                gl.store(ds_part_ptr + pid_n.to(gl.int64) * R + rows, ds, mask=rmask)
        mbarrier.arrive(acc_empty.index(0))


@gluon.jit
def down_swiglu_bwd_kernel(dy_ptr, stride_yl, token_ptr, n_rows, w_desc, preact_ptr, dpreact_ptr, act_scaled_ptr,
                           w_sorted_ptr, ds_part_ptr, stride_pl, stride_dl, stride_al, tile_expert_ptr, tile_row_ptr,
                           used_tiles_ptr, expert_offsets_ptr, H, K_DIM, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                           WORKER_REGS: gl.constexpr):
    """dA' = dy[token[rows]] @ W2[e] (W2 as its (E·D, h) view) and the SwiGLU backward of each tile beside the
    next tile's MMAs: the 8-warp MMA partition (default), a 2-warp gathering loader, a 2-warp epilogue."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], w_desc.dtype)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], w_desc.dtype)
    a_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], w_desc.layout)
    c_smem = gl.allocate_shared_memory(w_desc.dtype, [BLOCK_M, BLOCK_N], c_layout)
    ready, empty = stage_barriers(STAGES, 32 * LOADER_WARPS + 1)
    acc_ready, acc_empty = one_barrier(), one_barrier()
    mma_args = (c_smem, acc_ready, acc_empty, a_bufs, b_bufs, ready, empty, used_tiles_ptr, gl.cdiv(H, BLOCK_N),
                K_DIM, True)
    loader_args = (dy_ptr, stride_yl, token_ptr, n_rows, w_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr,
                   tile_row_ptr, used_tiles_ptr, H, K_DIM)
    epi_args = (c_smem, acc_ready, acc_empty, preact_ptr, dpreact_ptr, act_scaled_ptr, w_sorted_ptr, ds_part_ptr,
                stride_pl, stride_dl, stride_al, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, H,
                n_rows)
    gl.warp_specialize([(mma_handoff, mma_args), (gather_loader, loader_args), (_dh_epilogue, epi_args)],
                       [LOADER_WARPS, EPI_WARPS], [WORKER_REGS, WORKER_REGS])



def down_swiglu_bwd(dy, w2, preact, w_sorted, token, offsets, sched, dpreact, block_k: int = 64, stages: int = 3,
                    worker_regs: int = 112):
    """The SwiGLU down-projection's backward for each expert's contiguous rows: dy (L, D), w2 (E, D, h) bf16/fp16
    contiguous, D a multiple of block_k, h of 8; preact (R, 2h) gate-first, contiguous; w_sorted (R,) fp32 router
    weights in row order; dpreact (R, 2h) receives dH (may be preact). Returns (s·A (R, h), the dS partials
    (cdiv(h, 256), R) fp32: their sum over the first axis is dS in row order). The dispatcher (experts.dispatch)
    checks the operands; the launcher does not."""
    E, D, h = w2.shape
    R = token.shape[0]
    block_n = 256
    act_scaled = dy.new_empty(R, h)
    ds_part = torch.empty(cdiv(h, block_n), R, dtype=torch.float32, device=dy.device)
    w_desc = descriptor(w2.reshape(E * D, h), [block_k, block_n])
    grid = (sm_count(dy.device),)
    launch(down_swiglu_bwd_kernel, grid, dy, dy.stride(0), token, R, w_desc, preact, dpreact, act_scaled, w_sorted,
           ds_part, preact.stride(0), dpreact.stride(0), act_scaled.stride(0), sched[0], sched[1], sched[2], offsets,
           h, D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, WORKER_REGS=worker_regs, num_warps=8,
           maxnreg=168)
    return act_scaled, ds_part


def _timed(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(3):
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / iters)
    return sorted(ts)[1]


def time_config(cfg: str) -> dict:
    """{gathered GEMM, two passes, fused: ms} of config cfg's down-projection backward."""
    L, d, h, E, K = CONFIGS[cfg]
    p = make_problem(L, d, h, E, K, n_sets=1)
    x, idx, w, dy = (t.detach() for t in p.sets[0])
    w1, w2 = p.w1.detach(), p.w2.detach()
    plan = RowPlan.build(build_routing_index(idx, E))
    preact, _ = stages.up(plan, x, w1, "swiglu", backend="gluon")
    dpre = torch.empty_like(preact)
    ws = in_row_order(w, plan.token_slot_LK, plan.token_R.shape[0], torch.float32)

    def gemm():
        return gluon_sm90.gathered_rows_gemm(dy, w2, plan.token_R, plan.offsets_E1, plan.sched)

    def two():
        a = gemm()
        stages.act_bwd(plan, a, preact, w, dpre, a, "swiglu")

    def fused():
        down_swiglu_bwd(dy, w2, preact, ws, plan.token_R, plan.offsets_E1, plan.sched, dpre)
    return {n: _timed(f) for n, f in (("gathered GEMM", gemm), ("two passes", two), ("fused", fused))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="B,D,E,A,C")
    for cfg in ap.parse_args().configs.split(","):
        print(cfg, " | ".join(f"{k} {v:.3f} ms" for k, v in time_config(cfg).items()), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
