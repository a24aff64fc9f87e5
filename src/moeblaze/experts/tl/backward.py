"""tl kernels of the backward pass: dA' = dy[token] @ W2[e] with the activation's backward in its epilogue
(down_bwd), the same epilogue as a pass of its own (act_bwd, after a dA' computed apart; it also reads H kept in
e4m3, dequantized as it is loaded), and the weight gradients, which reduce over each expert's rows and gather one
side through expert_token_idx.

Memory: nothing beyond the outputs, and down_bwd's fp32 router-gradient partials (H / DS_BLOCK per row).
"""
import triton
import triton.language as tl

from ...env import INTERPRET
from ...reference.fp8 import AMAX_FLOOR, FP8_MAX, GROUP, INV_FP8_MAX
from .common import _act, _act_grad, _clamped_glu, _pair_cols, _row_ptrs, _rows_dot, _swizzle, _tile_rows
from .configs import DH_CONFIGS, WGRAD_CONFIGS
from ..quant import _group_amax, _quantize_gate_up, _reciprocal, _spread, _store_scaled

FP8_GROUP: tl.constexpr = tl.constexpr(GROUP)  # the columns of one e4m3 scale
# the quantizer's constants (experts.quant), for dH quantized where the dH pass writes it
Q_AMAX_FLOOR: tl.constexpr = tl.constexpr(AMAX_FLOOR)
Q_INV_MAX: tl.constexpr = tl.constexpr(INV_FP8_MAX)
Q_MAX: tl.constexpr = tl.constexpr(FP8_MAX)
Q_EMULATE: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def _load_h(preact_ptr, rows, rmask, col0, H, stride_pl, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """The saved pre-activation (gate, up) of rows x pairs col0 .. col0+BLOCK_N (up is gate if not GATED)."""
    offs_n = col0 + tl.arange(0, BLOCK_N)
    mask = rmask[:, None] & (offs_n < H)[None, :]
    if GATED:
        cols, up_off = _pair_cols(offs_n, H, INTERLEAVED)
        ptrs = _row_ptrs(preact_ptr, rows, stride_pl, cols)
        return tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + up_off, mask=mask, other=0.0)
    g = tl.load(_row_ptrs(preact_ptr, rows, stride_pl, offs_n), mask=mask, other=0.0)
    return g, g


@triton.jit
def _load_h_halves(preact_ptr, rows, rmask, col0, H, stride_pl, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
                   HALF: tl.constexpr, EPI_SPLIT: tl.constexpr):
    """(g0, u0, g1, u1): H of the tile's first HALF columns and, when EPI_SPLIT == 2, of its second."""
    g0, u0 = _load_h(preact_ptr, rows, rmask, col0, H, stride_pl, GATED, INTERLEAVED, HALF)
    if EPI_SPLIT == 2:
        g1, u1 = _load_h(preact_ptr, rows, rmask, col0 + HALF, H, stride_pl, GATED, INTERLEAVED, HALF)
        return g0, u0, g1, u1
    return g0, u0, g0, u0


@triton.jit
def _store_dh_and_sa(dact, g, u, s, rows, cols, dpreact_ptr, act_scaled_ptr, stride_pl, stride_al, H, mask,
                     GATED: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr):
    """From dA' (fp32) of rows x pairs cols, H there (g; u too if GATED) and the rows' router weights s: stores
    dH = d act(s * dA') into dpreact (gate and up columns as _pair_cols places them) and s * A into act_scaled;
    returns A (fp32), for dS, and dH's gate and up parts as stored (up is gate if not GATED; unused, they
    cost nothing). The s * A addresses are formed at their store (held across the dH math, they
    cost the fused dH kernel ~90 B more of spills per thread, sm_90, triton 3.6)."""
    g = g.to(tl.float32)
    if GATED:
        pcols, up_off = _pair_cols(cols, H, INTERLEAVED)
        dp_ptrs = _row_ptrs(dpreact_ptr, rows, stride_pl, pcols)
        u = u.to(tl.float32)
        das = dact * s[:, None]
        if ACT == 4:
            a, dg, du = _clamped_glu(g, u)
            dh_g = (das * dg).to(dpreact_ptr.dtype.element_ty)
            tl.store(dp_ptrs, dh_g, mask=mask)
            dh_u = (das * du).to(dpreact_ptr.dtype.element_ty)
        else:
            act_g = _act(g, ACT)
            a = act_g * u
            dh_g = (das * u * _act_grad(g, ACT)).to(dpreact_ptr.dtype.element_ty)
            tl.store(dp_ptrs, dh_g, mask=mask)
            dh_u = (das * act_g).to(dpreact_ptr.dtype.element_ty)
        tl.store(dp_ptrs + up_off, dh_u, mask=mask)
    else:
        a = _act(g, ACT)
        dh_g = (dact * s[:, None] * _act_grad(g, ACT)).to(dpreact_ptr.dtype.element_ty)
        dh_u = dh_g
        tl.store(_row_ptrs(dpreact_ptr, rows, stride_pl, cols), dh_g, mask=mask)
    tl.store(_row_ptrs(act_scaled_ptr, rows, stride_al, cols), (a * s[:, None]).to(act_scaled_ptr.dtype.element_ty),
             mask=mask)
    return a, dh_g, dh_u


@triton.jit
def _dh_epilogue(dact, col0, rows, rmask, g, u, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr, H, LK,
                 stride_pl, stride_al, GATED: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr,
                 DS_BLOCK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dH epilogue of columns col0 .. col0+BLOCK_N of dA', given H there (g, u)."""
    offs_n = col0 + tl.arange(0, BLOCK_N)
    omask = rmask[:, None] & (offs_n < H)[None, :]
    g = g.to(tl.float32)  # before the router weights' load, as before the helper: ptxas then spills no more
    s = tl.load(w_sorted_ptr + rows, mask=rmask, other=0.0)
    a, _, _ = _store_dh_and_sa(dact, g, u, s, rows, offs_n, dpreact_ptr, act_scaled_ptr, stride_pl, stride_al, H,
                               omask, GATED, ACT, INTERLEAVED)
    R: tl.constexpr = BLOCK_N // DS_BLOCK
    ds = tl.sum(tl.reshape(dact * a, (BLOCK_M, R, DS_BLOCK)), axis=2)  # (BLOCK_M, R)
    slot = col0 // DS_BLOCK + tl.arange(0, R)
    row0 = tl.min(rows)
    tl.store((ds_part_ptr + row0 + slot.to(tl.int64) * LK)[None, :] + (rows - row0)[:, None], ds,
             mask=rmask[:, None] & (slot * DS_BLOCK < H)[None, :])


@triton.jit
def _read_back(v, scale, OUT_TY: tl.constexpr):
    """e4m3 values v as quant.dequantize_rows writes them: v · scale in fp32, rounded to the io dtype OUT_TY, in
    fp32."""
    return (v.to(tl.float32) * scale).to(OUT_TY).to(tl.float32)


@triton.jit
def _dequant(v, scale_ptr, rows, mask, cols, stride_s, OUT_TY: tl.constexpr):
    """_read_back of e4m3 values v of rows x cols, one scale per row and FP8_GROUP columns, loaded for each
    element under its mask (a column past H has no scale: its group may lie past the row's)."""
    s = tl.load(scale_ptr + rows.to(tl.int64)[:, None] * stride_s + (cols // FP8_GROUP)[None, :], mask=mask,
                other=0.0)
    return _read_back(v, s, OUT_TY)


@triton.jit
def _run_scales(scale_ptr, rows, rmask, g0, n_groups, stride_s, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                RUN: tl.constexpr):
    """The scales of BLOCK_H consecutive pairs whose scale changes every RUN of them, from group g0 on: one load
    per row and group, spread over the run (BLOCK_R, BLOCK_H)."""
    NG: tl.constexpr = BLOCK_H // RUN
    groups = g0 + tl.arange(0, NG)
    s = tl.load(scale_ptr + rows.to(tl.int64)[:, None] * stride_s + groups[None, :],
                mask=rmask[:, None] & (groups < n_groups)[None, :], other=0.0)
    return _spread(s, BLOCK_R, NG, RUN)


@triton.jit
def _dequant_h(g, u, scale_ptr, rows, rmask, mask, c0, cols, H, stride_s, OUT_TY: tl.constexpr, GATED: tl.constexpr,
               INTERLEAVED: tl.constexpr, H_ALIGNED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """(gate, up) of H in e4m3 for pairs c0 .. c0 + BLOCK_H, read back (_read_back) in fp32: the scales loaded once
    per row and group where a group's columns fall within the pass (interleaved, plain, or gate-first with
    H_ALIGNED), else once per element."""
    n_groups = tl.cdiv(2 * H if GATED else H, FP8_GROUP)
    if GATED and INTERLEAVED:  # gate and up of 64 pairs share a group: one set of scales for both
        s = _run_scales(scale_ptr, rows, rmask, c0 // (FP8_GROUP // 2), n_groups, stride_s, BLOCK_R, BLOCK_H,
                        FP8_GROUP // 2)
        return _read_back(g, s, OUT_TY), _read_back(u, s, OUT_TY)
    if GATED and H_ALIGNED:  # gate-first, H a multiple of 128: up's groups start at H / 128
        sg = _run_scales(scale_ptr, rows, rmask, c0 // FP8_GROUP, n_groups, stride_s, BLOCK_R, BLOCK_H, FP8_GROUP)
        su = _run_scales(scale_ptr, rows, rmask, (H + c0) // FP8_GROUP, n_groups, stride_s, BLOCK_R, BLOCK_H,
                         FP8_GROUP)
        return _read_back(g, sg, OUT_TY), _read_back(u, su, OUT_TY)
    if GATED:  # up's groups straddle the pass's columns: a scale per element
        pcols, up_off = _pair_cols(cols, H, INTERLEAVED)
        return (_dequant(g, scale_ptr, rows, mask, pcols, stride_s, OUT_TY),
                _dequant(u, scale_ptr, rows, mask, pcols + up_off, stride_s, OUT_TY))
    s = _run_scales(scale_ptr, rows, rmask, c0 // FP8_GROUP, n_groups, stride_s, BLOCK_R, BLOCK_H, FP8_GROUP)
    g = _read_back(g, s, OUT_TY)
    return g, g


@triton.jit
def _quantize_dh(dh_g, dh_u, rows, rmask, c0, H, dq_ptr, dqs_ptr, stride_dq, stride_dqs, GATED: tl.constexpr,
                 INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """dH's columns of pairs c0 .. c0 + BLOCK_H (gate and up parts as stored, fp32) quantized in dH's own 1 x 128
    groups, as quant.quantize_rows(dH) writes them: q into dq, the scales into dqs. BLOCK_H is a multiple of 128;
    gate-first dH needs H a multiple of 128 too (its up groups start at H), checked on the host."""
    cols = c0 + tl.arange(0, BLOCK_H)
    mask = rmask[:, None] & (cols < H)[None, :]
    dh_g = tl.where(mask, dh_g, 0.0)
    dh_u = tl.where(mask, dh_u, 0.0)
    r64 = rows.to(tl.int64)
    q_rows = dq_ptr + r64[:, None] * stride_dq
    s_rows = dqs_ptr + r64[:, None] * stride_dqs
    if GATED and INTERLEAVED:  # a group: gate and up of 64 pairs, side by side
        _quantize_gate_up(dh_g, dh_u, mask, q_rows, cols, s_rows, 2 * c0 // FP8_GROUP, rmask, 2 * H, BLOCK_R,
                          2 * BLOCK_H // FP8_GROUP, FP8_GROUP // 2, Q_AMAX_FLOOR, Q_INV_MAX, Q_MAX, Q_EMULATE)
    else:
        NG: tl.constexpr = BLOCK_H // FP8_GROUP
        groups = c0 // FP8_GROUP + tl.arange(0, NG)
        smask = rmask[:, None] & (groups * FP8_GROUP < H)[None, :]
        scale = tl.maximum(_group_amax(dh_g, BLOCK_R, NG, FP8_GROUP), Q_AMAX_FLOOR,
                           propagate_nan=tl.PropagateNan.ALL) * Q_INV_MAX
        _store_scaled(dh_g, _spread(_reciprocal(scale), BLOCK_R, NG, FP8_GROUP), mask, q_rows + cols[None, :], Q_MAX,
                      Q_EMULATE)
        tl.store(s_rows + groups[None, :], scale, mask=smask)
        if GATED:  # up: columns H + j, groups H / 128 on
            scale = tl.maximum(_group_amax(dh_u, BLOCK_R, NG, FP8_GROUP), Q_AMAX_FLOOR,
                               propagate_nan=tl.PropagateNan.ALL) * Q_INV_MAX
            _store_scaled(dh_u, _spread(_reciprocal(scale), BLOCK_R, NG, FP8_GROUP), mask, q_rows + H + cols[None, :],
                          Q_MAX, Q_EMULATE)
            tl.store(s_rows + H // FP8_GROUP + groups[None, :], scale, mask=smask)


@triton.jit
def _act_bwd_kernel(dact_ptr, preact_ptr, preact_scale_ptr, expert_token_idx_ptr, token_slot_ptr, topk_w_ptr,
                    dpreact_ptr, act_scaled_ptr, dtopk_w_ptr, dq_ptr, dqs_ptr, LK, H, stride_dl, stride_pl,
                    stride_ps, stride_al, stride_dq, stride_dqs, K: tl.constexpr, GATED: tl.constexpr,
                    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, FP8_H: tl.constexpr, H_ALIGNED: tl.constexpr,
                    QUANT_DH: tl.constexpr, WIDE: tl.constexpr, K_POW2: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """The dH epilogue as a pass of its own over BLOCK_R rows, for a dA' = dy[token] @ W2[e] computed
    apart (the Hopper path): from dA' and H, dH = d act(s * dA'), s * A, and dS[r] = <dA'[r], A[r]>
    whole (no partials), stored straight into the router-weight gradient (L, K) in its dtype. A row r of
    token t is the pair (t, k) with token_slot[t, k] == r: its weight is read from topk_w there and its
    dS stored there, so no row-order copy of the weights exists. dpreact may be preact and act_scaled
    may be dact: each element is read before it is written, by the same thread. FP8_H: H is e4m3 with one fp32
    scale per row and 128 of its columns (preact_scale), read back as it is loaded: no dequantized copy; its scales
    are loaded once per row and group where a group's columns fall within the pass (H_ALIGNED: H a multiple of 128,
    which gate-first H needs; interleaved and plain H always), else once per element. QUANT_DH:
    dH is also quantized as it is stored (dq, dqs: quant.quantize_rows(dH)'s pair), for precision="fp8"'s dX~.
    WIDE (a token-rounded routing's table of K places, most empty): each row's token's places are read in one
    load."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < LK
    pair0 = tl.load(expert_token_idx_ptr + rows, mask=rmask, other=0) * K
    if WIDE:
        kk = tl.arange(0, K_POW2)
        places = pair0[:, None] + kk[None, :]
        slots = tl.load(token_slot_ptr + places, mask=rmask[:, None] & (kk < K)[None, :], other=-1)
        pair = tl.max(tl.where(slots == rows[:, None], places, -1), axis=1)
    else:
        pair = tl.full((BLOCK_R,), -1, tl.int32)
        for k in tl.static_range(K):
            pair = tl.where(tl.load(token_slot_ptr + pair0 + k, mask=rmask, other=-1) == rows, pair0 + k, pair)
    # a row that no pair names (the unused tail of a rounded routing's static row buffer) stores no dS
    rmask &= pair >= 0
    pair = tl.maximum(pair, 0)
    s = tl.load(topk_w_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
    ds = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, H, BLOCK_H):
        cols = c0 + tl.arange(0, BLOCK_H)
        mask = rmask[:, None] & (cols < H)[None, :]
        da = tl.load(_row_ptrs(dact_ptr, rows, stride_dl, cols), mask=mask, other=0.0).to(tl.float32)
        g, u = _load_h(preact_ptr, rows, rmask, c0, H, stride_pl, GATED, INTERLEAVED, BLOCK_H)
        if FP8_H:
            g, u = _dequant_h(g, u, preact_scale_ptr, rows, rmask, mask, c0, cols, H, stride_ps,
                              dpreact_ptr.dtype.element_ty, GATED, INTERLEAVED, H_ALIGNED, BLOCK_R, BLOCK_H)
        a, dh_g, dh_u = _store_dh_and_sa(da, g, u, s, rows, cols, dpreact_ptr, act_scaled_ptr, stride_pl, stride_al,
                                         H, mask, GATED, ACT, INTERLEAVED)
        if QUANT_DH:
            _quantize_dh(dh_g.to(tl.float32), dh_u.to(tl.float32), rows, rmask, c0, H, dq_ptr, dqs_ptr, stride_dq,
                         stride_dqs, GATED, INTERLEAVED, BLOCK_R, BLOCK_H)
        ds += tl.sum(da * a, axis=1)
    tl.store(dtopk_w_ptr + pair, ds.to(dtopk_w_ptr.dtype.element_ty), mask=rmask)


# restore_value: under checkpoint="recompute" the kernel writes dH over the H it reads, so the tuner's
# repeated trial launches must each start from the original H.
@triton.autotune(configs=DH_CONFIGS, key=["D", "H", "GATED"], restore_value=["preact_ptr"])
@triton.jit
def _down_bwd_kernel(
    dy_ptr, w2_ptr, w2_desc, preact_ptr, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr,
    expert_token_idx_ptr, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
    NUM_TILES, D, H, LK, stride_dyl, stride_dyd, stride_we, stride_wd, stride_wh, stride_pl, stride_al,
    GATED: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr, DS_BLOCK: tl.constexpr,
    PREFETCH_H: tl.constexpr,
    EPI_SPLIT: tl.constexpr, W2_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, GROUP_M: tl.constexpr,
):
    """dA' = dy[token] @ W2[e] (dy gathered in the load), then in the epilogue, from the saved H:
    A = act(H) recomputed; dS partials = <dA', A> per DS_BLOCK columns (the router-weight gradient,
    without the down-projection output); dH = d act(s * dA'); s * A for dW2.
    H is loaded before the main loop (PREFETCH_H, its latency hidden behind the loop) or right after
    it, all at once; EPI_SPLIT = 2 or 4 runs the epilogue math on column halves or quarters (fewer
    live registers). W2_TMA reads W2 through the descriptor w2_desc over its (E·D, H) view."""
    tile, pid_n = _swizzle(tl.program_id(0), NUM_TILES, tl.cdiv(H, BLOCK_N), GROUP_M)
    e, rows, rmask = _tile_rows(tile, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, BLOCK_M)
    if e < 0:
        return
    tok = tl.load(expert_token_idx_ptr + rows, mask=rmask, other=0)
    col0 = pid_n * BLOCK_N
    offs_n = col0 + tl.arange(0, BLOCK_N)
    HALF: tl.constexpr = BLOCK_N // EPI_SPLIT
    PARTS: tl.constexpr = 2 if EPI_SPLIT > 1 else 1  # H parts loaded here (EPI_SPLIT = 4: the first two)
    if PREFETCH_H:
        g0, u0, g1, u1 = _load_h_halves(preact_ptr, rows, rmask, col0, H, stride_pl, GATED, INTERLEAVED, HALF, PARTS)
    dact = _rows_dot(dy_ptr, tok, rmask, stride_dyl, stride_dyd, w2_ptr + e.to(tl.int64) * stride_we, stride_wd,
                     stride_wh, offs_n, offs_n < H, D, dy_ptr, w2_desc, e * D, False, W2_TMA, False,
                     BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    if not PREFETCH_H:
        g0, u0, g1, u1 = _load_h_halves(preact_ptr, rows, rmask, col0, H, stride_pl, GATED, INTERLEAVED, HALF, PARTS)
    if EPI_SPLIT == 1:
        _dh_epilogue(dact, col0, rows, rmask, g0, u0, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr, H, LK,
                     stride_pl, stride_al, GATED, ACT, INTERLEAVED, DS_BLOCK, BLOCK_M, BLOCK_N)
    elif EPI_SPLIT == 4:
        # quarters of Q columns: column i·2Q + j·Q + q sits at [q, i, j] after the permute
        Q: tl.constexpr = BLOCK_N // 4
        lo, hi = tl.split(tl.permute(tl.reshape(dact, (BLOCK_M, 2, 2, Q)), (0, 3, 1, 2)))
        d0, d2 = tl.split(lo)
        d1, d3 = tl.split(hi)
        _dh_epilogue(d0, col0, rows, rmask, g0, u0, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr, H, LK,
                     stride_pl, stride_al, GATED, ACT, INTERLEAVED, DS_BLOCK, BLOCK_M, Q)
        _dh_epilogue(d1, col0 + Q, rows, rmask, g1, u1, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr, H,
                     LK, stride_pl, stride_al, GATED, ACT, INTERLEAVED, DS_BLOCK, BLOCK_M, Q)
        g2, u2, g3, u3 = _load_h_halves(preact_ptr, rows, rmask, col0 + 2 * Q, H, stride_pl, GATED, INTERLEAVED, Q, 2)
        _dh_epilogue(d2, col0 + 2 * Q, rows, rmask, g2, u2, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr,
                     H, LK, stride_pl, stride_al, GATED, ACT, INTERLEAVED, DS_BLOCK, BLOCK_M, Q)
        _dh_epilogue(d3, col0 + 3 * Q, rows, rmask, g3, u3, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr,
                     H, LK, stride_pl, stride_al, GATED, ACT, INTERLEAVED, DS_BLOCK, BLOCK_M, Q)
    else:
        d0, d1 = tl.split(tl.permute(tl.reshape(dact, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        _dh_epilogue(d0, col0, rows, rmask, g0, u0, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr, H, LK,
                     stride_pl, stride_al, GATED, ACT, INTERLEAVED, DS_BLOCK, BLOCK_M, HALF)
        _dh_epilogue(d1, col0 + HALF, rows, rmask, g1, u1, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr,
                     H, LK, stride_pl, stride_al, GATED, ACT, INTERLEAVED, DS_BLOCK, BLOCK_M, HALF)


@triton.autotune(configs=WGRAD_CONFIGS, key=["N", "P", "GATHER_P", "GATHER_Q"])
@triton.jit
def _weight_grad_kernel(
    p_ptr, q_ptr, dense_desc, dw_ptr, expert_token_idx_ptr, expert_offsets_ptr,
    N, P, stride_pl, stride_pn, stride_ql, stride_qp, stride_de, stride_dn, stride_dp,
    GATHER_P: tl.constexpr, GATHER_Q: tl.constexpr, DENSE_TMA: tl.constexpr, SWAP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """dW[e] = Pm[rows of e]^T @ Qm[rows of e], reducing over the expert's rows; either side may be
    gathered from a token matrix through expert_token_idx. An expert with no rows gets zeros.
    SWAP computes the transposed tile, (Qm^T @ Pm)^T, so the other operand is the MMA's A operand.
    The token ids of the next row block are loaded one iteration early: loaded in the iteration that
    uses them, they make the data loads indirect and Triton's pipeliner then keeps one stage fewer
    (the weight gradients went from ~420 to 480-536 TF/s on the H200 at configs B and E).
    DENSE_TMA (exactly one side gathered) loads the other, row-contiguous side through the tensor
    descriptor dense_desc (block BLOCK_K rows): its rows past the expert's end are the next expert's,
    and meet the gathered side's zeros there."""
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    n_tiles_p = tl.cdiv(P, BLOCK_P)
    e = pid // (n_tiles_n * n_tiles_p)
    rem = pid % (n_tiles_n * n_tiles_p)
    pid_n, pid_p = rem // n_tiles_p, rem % n_tiles_p
    start = tl.load(expert_offsets_ptr + e)
    end = tl.load(expert_offsets_ptr + e + 1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    nmask = offs_n < N
    pmask = offs_p < P
    if SWAP:
        acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_P), dtype=tl.float32)
    rows_k = tl.arange(0, BLOCK_K)
    tok_next = tl.load(expert_token_idx_ptr + start + rows_k, mask=start + rows_k < end, other=0)
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + rows_k
        rmask = rows < end
        tok = tok_next
        tok_next = tl.load(expert_token_idx_ptr + rows + BLOCK_K, mask=rows + BLOCK_K < end, other=0)
        p_rows = (tok if GATHER_P else rows).to(tl.int64)
        q_rows = (tok if GATHER_Q else rows).to(tl.int64)
        if SWAP:  # qt (BLOCK_P, BLOCK_K), pt (BLOCK_K, BLOCK_N)
            if DENSE_TMA and GATHER_P:
                qt = tl.trans(dense_desc.load([r0, pid_p * BLOCK_P]))
            else:
                qt = tl.load(q_ptr + q_rows[None, :] * stride_ql + offs_p[:, None] * stride_qp,
                             mask=pmask[:, None] & rmask[None, :], other=0.0)
            if DENSE_TMA and GATHER_Q:
                pt = dense_desc.load([r0, pid_n * BLOCK_N])
            else:
                pt = tl.load(p_ptr + p_rows[:, None] * stride_pl + offs_n[None, :] * stride_pn,
                             mask=rmask[:, None] & nmask[None, :], other=0.0)
            acc = tl.dot(qt, pt, acc, input_precision=PRECISION)
        else:  # pt (BLOCK_N, BLOCK_K), qt (BLOCK_K, BLOCK_P)
            if DENSE_TMA and GATHER_Q:
                pt = tl.trans(dense_desc.load([r0, pid_n * BLOCK_N]))
            else:
                pt = tl.load(p_ptr + p_rows[None, :] * stride_pl + offs_n[:, None] * stride_pn,
                             mask=nmask[:, None] & rmask[None, :], other=0.0)
            if DENSE_TMA and GATHER_P:
                qt = dense_desc.load([r0, pid_p * BLOCK_P])
            else:
                qt = tl.load(q_ptr + q_rows[:, None] * stride_ql + offs_p[None, :] * stride_qp,
                             mask=rmask[:, None] & pmask[None, :], other=0.0)
            acc = tl.dot(pt, qt, acc, input_precision=PRECISION)
    dw = dw_ptr + e.to(tl.int64) * stride_de
    if SWAP:
        tl.store(dw + offs_n[None, :] * stride_dn + offs_p[:, None] * stride_dp, acc.to(dw_ptr.dtype.element_ty),
                 mask=pmask[:, None] & nmask[None, :])
    else:
        tl.store(dw + offs_n[:, None] * stride_dn + offs_p[None, :] * stride_dp, acc.to(dw_ptr.dtype.element_ty),
                 mask=nmask[:, None] & pmask[None, :])
