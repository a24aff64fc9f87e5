"""tl kernels of the forward pass: the up-projection of gathered rows with the activation in its epilogue, the
row GEMM (the down-projection, and dX~ in backward) and the combine (a per-token gather-sum, also dx).

Rows are the L·K (token, expert) pairs in expert order (RoutingIndex.expert_token_idx). A row GEMM program
owns one tile of BLOCK_M rows of one expert (from the tile schedule built on the device) and one BLOCK_N
column tile; the up-projection loads its rows of x straight from the token matrix through expert_token_idx,
so no (L·K, D) copy of x exists. Accumulation is fp32 everywhere. Memory: nothing beyond the outputs.
"""
import triton
import triton.language as tl

from .common import _act, _clamped_glu, _pair_cols, _row_ptrs, _rows_dot, _swizzle, _tile_rows
from .configs import ROWS_CONFIGS, UP_CONFIGS


@triton.jit
def _gate_up_dot(x_ptr, tok, rmask, stride_xl, stride_xd, w_e, stride_wf, stride_wd, offs_n, nmask, D, H,
                 w1_desc, w_row0, W1_TMA: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 (gate, up), each (BLOCK_M, BLOCK_N): the gathered x rows against the gate rows and the up rows
    of pairs offs_n of W1[e], two MMAs on one A tile; W1 through w1_desc over its (E·F, D) view
    (this expert's first row w_row0) where W1_TMA (never INTERLEAVED)."""
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = x_ptr + tok.to(tl.int64)[:, None] * stride_xl
    n0 = tl.min(offs_n)
    gate_rows, up_off = _pair_cols(offs_n, H, INTERLEAVED)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < D
        a = tl.load(a_base + offs_k[None, :] * stride_xd, mask=rmask[:, None] & kmask[None, :], other=0.0)
        if W1_TMA:
            bg = tl.trans(w1_desc.load([w_row0 + n0, k0]))
            bu = tl.trans(w1_desc.load([w_row0 + H + n0, k0]))
        else:
            b_ptrs = w_e + gate_rows[None, :] * stride_wf + offs_k[:, None] * stride_wd
            bmask = kmask[:, None] & nmask[None, :]
            bg = tl.load(b_ptrs, mask=bmask, other=0.0)
            bu = tl.load(b_ptrs + up_off * stride_wf, mask=bmask, other=0.0)
        acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
    return acc_g, acc_u


@triton.autotune(configs=UP_CONFIGS, key=["D", "H", "GATED", "STORE_PREACT", "STORE_ACT"])
@triton.jit
def _up_kernel(
    x_ptr, w1_ptr, w1_desc, b1_ptr, preact_ptr, act_ptr, expert_token_idx_ptr, tile_expert_ptr, tile_row_ptr,
    expert_offsets_ptr, NUM_TILES, D, H, stride_xl, stride_xd, stride_we, stride_wf, stride_wd, stride_be, stride_bf,
    stride_pl, stride_al, GATED: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_B1: tl.constexpr,
    STORE_PREACT: tl.constexpr, STORE_ACT: tl.constexpr, W1_TMA: tl.constexpr, TWO_DOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Up-projection of gathered x rows (+ the bias b1[e] where HAS_B1) with the activation in the epilogue:
    writes A = act(H) (the down-projection input) and, if STORE_PREACT, the pre-activation H for backward,
    its gate/up columns in W1's row order (INTERLEAVED or not). Gated: one wide MMA over interleaved
    gate/up weight rows, or (TWO_DOTS) two MMAs on separate gate and up tiles, which W1 can feed through
    a tensor descriptor (W1_TMA)."""
    tile, pid_n = _swizzle(tl.program_id(0), NUM_TILES, tl.cdiv(H, BLOCK_N), GROUP_M)
    e, rows, rmask = _tile_rows(tile, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, BLOCK_M)
    if e < 0:
        return
    tok = tl.load(expert_token_idx_ptr + rows, mask=rmask, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < H
    w_e = w1_ptr + e.to(tl.int64) * stride_we
    b_e = b1_ptr + e.to(tl.int64) * stride_be
    omask = rmask[:, None] & nmask[None, :]
    if GATED:
        if TWO_DOTS:
            gate, up = _gate_up_dot(x_ptr, tok, rmask, stride_xl, stride_xd, w_e, stride_wf, stride_wd, offs_n,
                                    nmask, D, H, w1_desc, e * 2 * H, W1_TMA, INTERLEAVED, BLOCK_M, BLOCK_N, BLOCK_K,
                                    PRECISION)
        else:
            # One (BLOCK_K, 2·BLOCK_N) weight tile holds the gate and up rows of pairs n .. n+BLOCK_N alternating
            # (column 2j: gate, 2j+1: up, of pair n+j), so a single wide MMA serves both; split afterwards.
            j = tl.arange(0, 2 * BLOCK_N)
            g_rows, u_off = _pair_cols(pid_n * BLOCK_N + j // 2, H, INTERLEAVED)
            acc = _rows_dot(x_ptr, tok, rmask, stride_xl, stride_xd, w_e, stride_wd, stride_wf,
                            g_rows + (j % 2) * u_off, (pid_n * BLOCK_N + j // 2) < H, D, x_ptr, w_e, 0, False,
                            False, False, BLOCK_M, 2 * BLOCK_N, BLOCK_K, PRECISION)
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        cols, up_off = _pair_cols(offs_n, H, INTERLEAVED)
        if HAS_B1:
            gate += tl.load(b_e + cols * stride_bf, mask=nmask, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_e + (cols + up_off) * stride_bf, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if STORE_PREACT:
            p_ptrs = _row_ptrs(preact_ptr, rows, stride_pl, cols)
            tl.store(p_ptrs, gate.to(preact_ptr.dtype.element_ty), mask=omask)
            tl.store(p_ptrs + up_off, up.to(preact_ptr.dtype.element_ty), mask=omask)
        if STORE_ACT:
            if ACT == 4:
                out, _, _ = _clamped_glu(gate, up)
            else:
                out = _act(gate, ACT) * up
            tl.store(_row_ptrs(act_ptr, rows, stride_al, offs_n), out.to(act_ptr.dtype.element_ty), mask=omask)
    else:
        gate = _rows_dot(x_ptr, tok, rmask, stride_xl, stride_xd, w_e, stride_wd, stride_wf, offs_n, nmask, D,
                         x_ptr, w1_desc, e * H, False, W1_TMA, True, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        if HAS_B1:
            gate += tl.load(b_e + offs_n * stride_bf, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if STORE_PREACT:
            tl.store(_row_ptrs(preact_ptr, rows, stride_pl, offs_n), gate.to(preact_ptr.dtype.element_ty),
                     mask=omask)
        if STORE_ACT:
            tl.store(_row_ptrs(act_ptr, rows, stride_al, offs_n), _act(gate, ACT).to(act_ptr.dtype.element_ty),
                     mask=omask)


@triton.autotune(configs=ROWS_CONFIGS, key=["N", "K_DIM"])
@triton.jit
def _rows_kernel(
    a_ptr, b_ptr, a_desc, b_desc, c_ptr, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, expert_offsets_ptr,
    NUM_TILES, N, K_DIM, B_ROWS, stride_al, stride_ad, stride_be, stride_bk, stride_bn, stride_cl,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_KMAJOR: tl.constexpr, PERSISTENT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C[rows] = A[rows] @ B[e] for every expert's contiguous rows (down-projection; dH @ W1); A and B
    through tensor descriptors where A_TMA / B_TMA (B_ROWS rows per expert in B's 2D view).
    PERSISTENT: one program per multiprocessor loops over the used tiles only (their count is read
    on the device), so the next tile's loads can be issued while this one's epilogue runs."""
    n_tn = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        n_used = tl.load(used_tiles_ptr)
        for t in tl.range(tl.program_id(0), n_used * n_tn, tl.num_programs(0), flatten=True):
            tile, pid_n = _swizzle(t, n_used, n_tn, GROUP_M)
            e, rows, rmask = _tile_rows(tile, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, BLOCK_M)
            _rows_tile(e, rows, rmask, pid_n, a_ptr, b_ptr, a_desc, b_desc, c_ptr, N, K_DIM, B_ROWS, stride_al,
                       stride_ad, stride_be, stride_bk, stride_bn, stride_cl, A_TMA, B_TMA, B_KMAJOR,
                       BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    else:
        tile, pid_n = _swizzle(tl.program_id(0), NUM_TILES, n_tn, GROUP_M)
        e, rows, rmask = _tile_rows(tile, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, BLOCK_M)
        if e < 0:
            return
        _rows_tile(e, rows, rmask, pid_n, a_ptr, b_ptr, a_desc, b_desc, c_ptr, N, K_DIM, B_ROWS, stride_al,
                   stride_ad, stride_be, stride_bk, stride_bn, stride_cl, A_TMA, B_TMA, B_KMAJOR,
                   BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)


@triton.jit
def _rows_tile(e, rows, rmask, pid_n, a_ptr, b_ptr, a_desc, b_desc, c_ptr, N, K_DIM, B_ROWS, stride_al,
               stride_ad, stride_be, stride_bk, stride_bn, stride_cl, A_TMA: tl.constexpr, B_TMA: tl.constexpr,
               B_KMAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PRECISION: tl.constexpr):
    """One (row tile of expert e, column tile pid_n) of the row GEMM."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    acc = _rows_dot(a_ptr, rows, rmask, stride_al, stride_ad, b_ptr + e.to(tl.int64) * stride_be, stride_bk,
                    stride_bn, offs_n, nmask, K_DIM, a_desc, b_desc, e * B_ROWS, A_TMA, B_TMA, B_KMAJOR,
                    BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    tl.store(_row_ptrs(c_ptr, rows, stride_cl, offs_n), acc.to(c_ptr.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _combine_slot(acc, k, t, tmask, cols, mask, kept, rows_ptr, token_slot_ptr, weights_ptr, bias_ptr, pair_expert_ptr,
                  stride_rl, stride_be, stride_bd, K: tl.constexpr, WEIGHTED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc + the tokens' k-th terms: (w[t, k] *) (rows[token_slot[t, k]] (+ bias)), 0 for a slot >= kept."""
    slot = tl.load(token_slot_ptr + t * K + k, mask=tmask, other=0)
    rmask = mask & (slot < kept)[:, None]
    slot = slot.to(tl.int64)
    r = tl.load(rows_ptr + slot[:, None] * stride_rl + cols[None, :], mask=rmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        e = tl.load(pair_expert_ptr + t * K + k, mask=tmask, other=0).to(tl.int64)
        r += tl.load(bias_ptr + e[:, None] * stride_be + cols[None, :] * stride_bd, mask=rmask,
                     other=0.0).to(tl.float32)
    if WEIGHTED:
        r = r * tl.load(weights_ptr + t * K + k, mask=tmask, other=0.0)[:, None]
    return acc + r


@triton.jit
def _combine_kernel(rows_ptr, token_slot_ptr, weights_ptr, kept_ptr, bias_ptr, pair_expert_ptr, out_ptr, L, D,
                    stride_rl, stride_be, stride_bd, stride_ol, K: tl.constexpr, WEIGHTED: tl.constexpr,
                    HAS_BIAS: tl.constexpr, WIDE: tl.constexpr, K_POW2: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """out[t] = sum_k (w[t, k] *) (rows[token_slot[t, k]] (+ bias[pair_expert[t, k]] where HAS_BIAS)): each
    token gathers its K rows, in fixed order, accumulated in fp32 (no atomics: deterministic). Slots >= kept
    (dropped pairs, never written) add 0. WIDE (a token-rounded routing's table, most of whose places are
    empty): the block's slots are read first and the sum stops after the last column any of its tokens uses."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = t < L
    mask = tmask[:, None] & (cols < D)[None, :]
    kept = tl.load(kept_ptr)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    if WIDE:
        kk = tl.arange(0, K_POW2)
        kmask = tmask[:, None] & (kk < K)[None, :]
        slots = tl.load(token_slot_ptr + t[:, None] * K + kk[None, :], mask=kmask, other=0)
        n_k = tl.max(tl.max(tl.where(kmask & (slots < kept), kk[None, :] + 1, 0), axis=1), axis=0)
        for k in range(0, n_k):
            acc = _combine_slot(acc, k, t, tmask, cols, mask, kept, rows_ptr, token_slot_ptr, weights_ptr, bias_ptr,
                                pair_expert_ptr, stride_rl, stride_be, stride_bd, K, WEIGHTED, HAS_BIAS)
    else:
        for k in tl.static_range(K):
            acc = _combine_slot(acc, k, t, tmask, cols, mask, kept, rows_ptr, token_slot_ptr, weights_ptr, bias_ptr,
                                pair_expert_ptr, stride_rl, stride_be, stride_bd, K, WEIGHTED, HAS_BIAS)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_ol + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)
