"""Triton kernels of the zero-buffer, fused expert computation (all experts in one launch each).

Rows are the L·K (token, expert) pairs in expert order (RoutingIndex.expert_token_idx). A row GEMM
program owns one tile of BLOCK_M rows of one expert (from the tile schedule built on the device) and
one BLOCK_N column tile; where GATHER is set it loads its rows of the input straight from the token
matrix through expert_token_idx, so no (L·K, D) copy of x or dy exists. Weight gradients loop over an
expert's rows (the reduction axis) and gather the same way. Accumulation is fp32 everywhere.

Activation codes (ACT): 0 SiLU, 1 GELU (erf), 2 ReLU, 3 squared ReLU. GATED: act(gate) * up, with the
gate columns of the pre-activation first and the up columns H further on.
"""
import os

import triton
import triton.language as tl

ACT_CODES = {"swiglu": 0, "geglu": 1, "silu": 0, "gelu": 1, "relu": 2, "relu2": 3}

# Launch configurations. Rows per tile (BLOCK_M) are fixed because the tile schedule is built for them;
# the rest is autotuned per shape on GPUs. Under the CPU interpreter (tests) one small config is used.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16 if INTERPRET else 128
# The dH kernel writes one router-gradient partial per DS_BLOCK columns (its BLOCK_N is a multiple).
DS_BLOCK = 16 if INTERPRET else 64
GROUP_M = 8  # row tiles that sweep the columns together, so a weight tile is reused from L2


def tma_ok(t) -> bool:
    """A row-major 2D tensor a tensor descriptor can address (16-byte aligned base and row stride)."""
    return (t is not None and t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)


def _configs(keys, gpu, interp, pre_hook=None):
    """Autotune configs from tuples (*values of keys, num_warps, num_stages); one small config under the
    interpreter."""
    def config(c):
        return triton.Config(dict(zip(keys, c[:-2])), num_warps=c[-2], num_stages=c[-1], pre_hook=pre_hook)
    return [config(interp)] if INTERPRET else [config(c) for c in gpu]


def _set_block(desc, shape):
    """Give a host tensor descriptor (a pointer otherwise: nothing to do) its block shape."""
    if hasattr(desc, "block_shape"):
        desc.block_shape = list(shape)


def _rows_blocks(nargs):
    _set_block(nargs["a_desc"], (nargs["BLOCK_M"], nargs["BLOCK_K"]))
    _set_block(nargs["b_desc"], (nargs["BLOCK_N"], nargs["BLOCK_K"]) if nargs["B_KMAJOR"]
               else (nargs["BLOCK_K"], nargs["BLOCK_N"]))


def _dh_blocks(nargs):
    _set_block(nargs["w2_desc"], (nargs["BLOCK_K"], nargs["BLOCK_N"]))


# row GEMMs (down-projection, dX~): (BLOCK_N, BLOCK_K, PERSISTENT, num_warps, num_stages)
ROWS_CONFIGS = _configs(("BLOCK_N", "BLOCK_K", "PERSISTENT"),
                        [(128, 64, 0, 8, 3), (128, 64, 0, 4, 4), (256, 64, 0, 8, 3), (256, 64, 0, 8, 4),
                         (128, 128, 0, 8, 3), (128, 64, 1, 8, 3), (256, 64, 1, 8, 3), (128, 64, 1, 8, 4)],
                        (32, 32, 1, 4, 1), pre_hook=_rows_blocks)
def _up_blocks(nargs):
    _set_block(nargs["w1_desc"], (nargs["BLOCK_N"], nargs["BLOCK_K"]))


# up-projection: (BLOCK_N, BLOCK_K, TWO_DOTS, num_warps, num_stages); gated, the MMA is BLOCK_M x 2·BLOCK_N
# (gate and up columns together) or two BLOCK_M x BLOCK_N ones (TWO_DOTS). 64-column 3-stage tiles, two
# programs per multiprocessor, were 5-25% slower at B and E, so they are not listed.
UP_CONFIGS = _configs(("BLOCK_N", "BLOCK_K", "TWO_DOTS"),
                      [(128, 64, 0, 8, 3), (64, 64, 0, 4, 4), (128, 64, 0, 8, 4), (64, 64, 0, 8, 4),
                       (128, 64, 1, 8, 3), (128, 64, 1, 8, 4), (64, 64, 1, 4, 4)],
                      (16, 32, 1, 4, 1), pre_hook=_up_blocks)
# dH: (BLOCK_N, BLOCK_K, PREFETCH_H, EPI_SPLIT, num_warps, num_stages); BLOCK_N / EPI_SPLIT a multiple of
# DS_BLOCK. Slower at every config measured, so not listed: persistent programs (the next tile's loads
# overlapping this one's epilogue, 3.9-5.8 against 3.0 ms at E) and 4-warp tiles for two programs per
# multiprocessor (they spill ~400 registers: 3.7 against 2.8 ms at E).
DH_CONFIGS = _configs(("BLOCK_N", "BLOCK_K", "PREFETCH_H", "EPI_SPLIT"),
                      [(256, 64, 0, 4, 8, 4), (256, 64, 0, 4, 8, 3), (128, 64, 0, 2, 8, 4), (128, 64, 0, 2, 8, 3),
                       (128, 64, 1, 2, 8, 4), (64, 64, 1, 1, 8, 3)],
                      (32, 32, 0, 2, 4, 1), pre_hook=_dh_blocks)
def _dense_block(nargs):
    _set_block(nargs["dense_desc"], (nargs["BLOCK_K"], nargs["BLOCK_P"] if nargs["GATHER_P"] else nargs["BLOCK_N"]))


# weight gradients: (BLOCK_N, BLOCK_P, BLOCK_K, SWAP, num_warps, num_stages)
WGRAD_CONFIGS = _configs(("BLOCK_N", "BLOCK_P", "BLOCK_K", "SWAP"),
                         [(128, 128, 32, 0, 4, 4), (128, 128, 64, 0, 8, 3), (128, 256, 64, 0, 8, 3),
                          (128, 128, 32, 1, 4, 4), (128, 128, 64, 1, 8, 3), (256, 128, 64, 1, 8, 3),
                          (128, 256, 64, 0, 8, 4)],
                         (32, 32, 32, 1, 4, 1), pre_hook=_dense_block)


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 0:
        return g * tl.sigmoid(g)
    elif ACT == 1:
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    elif ACT == 2:
        return tl.maximum(g, 0.0)
    else:
        r = tl.maximum(g, 0.0)
        return r * r


@triton.jit
def _act_grad(g, ACT: tl.constexpr):
    """d act(g) / d g, recomputed from the saved pre-activation."""
    if ACT == 0:
        s = tl.sigmoid(g)
        return s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        return 0.5 * (1.0 + tl.erf(g * 0.7071067811865476)) + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    elif ACT == 2:
        return (g > 0.0).to(g.dtype)
    else:
        return 2.0 * tl.maximum(g, 0.0)


@triton.jit
def _swizzle(pid, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid: GROUP_M row tiles sweep the columns together."""
    width = GROUP_M * n_tiles_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(n_tiles_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _tile_rows(tile, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, BLOCK_M: tl.constexpr):
    """(expert, row ids, row mask) of one schedule tile; expert < 0 marks an unused tile."""
    e = tl.load(tile_expert_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(expert_offsets_ptr + e + 1, mask=e >= 0, other=0)
    rows = row0 + tl.arange(0, BLOCK_M)
    return e, rows, rows < row_end


@triton.jit
def _row_ptrs(ptr, rows, stride, cols):
    """ptr + rows·stride + cols over a tile's consecutive rows: one 64-bit base at the first row, int32
    offsets from it. Per-element 64-bit addresses held the dH epilogue's spills at 448 B per thread
    against 328 (sm_90, ahead-of-time compile; no time difference measured at config E)."""
    row0 = tl.min(rows)
    return ptr + row0.to(tl.int64) * stride + ((rows - row0)[:, None] * stride + cols[None, :])


@triton.jit
def _rows_dot(a_ptr, a_rows, rmask, stride_al, stride_ad, b_ptr, stride_bk, stride_bn, offs_n, nmask, K_DIM,
              a_desc, b_desc, b_row0, A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 (BLOCK_M, BLOCK_N) = A[a_rows, :K_DIM] @ B[:K_DIM, offs_n] (B addressed by strides).

    A_TMA: a_rows are contiguous and A is read through the descriptor a_desc (block BLOCK_M x BLOCK_K).
    B_TMA: B is read through b_desc over the 2D view of all experts' weights, this expert's first row
    b_row0, as (n, k) rows if B_KMAJOR else (k, n). A descriptor reads whole blocks: rows of the next
    expert past K_DIM meet A's zero columns, and columns past N are never stored."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_al
    b_base = b_ptr + offs_n[None, :] * stride_bn
    row0 = tl.min(a_rows)  # the descriptor paths address blocks by their first row / column
    n0 = tl.min(offs_n)
    for k0 in range(0, K_DIM, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K_DIM
        if A_TMA:
            a = a_desc.load([row0, k0])
        else:
            a = tl.load(a_base + offs_k[None, :] * stride_ad, mask=rmask[:, None] & kmask[None, :], other=0.0)
        if B_TMA:
            if B_KMAJOR:
                b = tl.trans(b_desc.load([b_row0 + n0, k0]))
            else:
                b = b_desc.load([b_row0 + k0, n0])
        else:
            b = tl.load(b_base + offs_k[:, None] * stride_bk, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gate_up_dot(x_ptr, tok, rmask, stride_xl, stride_xd, w_e, stride_wf, stride_wd, offs_n, nmask, D, H,
                 w1_desc, w_row0, W1_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 (gate, up), each (BLOCK_M, BLOCK_N): the gathered x rows against the gate rows offs_n and the
    up rows H + offs_n of W1[e], two MMAs on one A tile; W1 through w1_desc over its (E·F, D) view
    (this expert's first row w_row0) where W1_TMA."""
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = x_ptr + tok.to(tl.int64)[:, None] * stride_xl
    n0 = tl.min(offs_n)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < D
        a = tl.load(a_base + offs_k[None, :] * stride_xd, mask=rmask[:, None] & kmask[None, :], other=0.0)
        if W1_TMA:
            bg = tl.trans(w1_desc.load([w_row0 + n0, k0]))
            bu = tl.trans(w1_desc.load([w_row0 + H + n0, k0]))
        else:
            b_ptrs = w_e + offs_n[None, :] * stride_wf + offs_k[:, None] * stride_wd
            bmask = kmask[:, None] & nmask[None, :]
            bg = tl.load(b_ptrs, mask=bmask, other=0.0)
            bu = tl.load(b_ptrs + H * stride_wf, mask=bmask, other=0.0)
        acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
    return acc_g, acc_u


@triton.autotune(configs=UP_CONFIGS, key=["D", "H", "GATED", "STORE_PREACT", "STORE_ACT"])
@triton.jit
def _expert_up_fwd_kernel(
    x_ptr, w1_ptr, w1_desc, preact_ptr, act_ptr, expert_token_idx_ptr, tile_expert_ptr, tile_row_ptr,
    expert_offsets_ptr, NUM_TILES, D, H, stride_xl, stride_xd, stride_we, stride_wf, stride_wd, stride_pl, stride_al,
    GATED: tl.constexpr, ACT: tl.constexpr, STORE_PREACT: tl.constexpr, STORE_ACT: tl.constexpr,
    W1_TMA: tl.constexpr, TWO_DOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Up-projection of gathered x rows with the activation in the epilogue: writes A = act(H) (the
    down-projection input) and, if STORE_PREACT, the pre-activation H for backward. Gated: one wide
    MMA over interleaved gate/up weight rows, or (TWO_DOTS) two MMAs on separate gate and up tiles,
    which W1 can feed through a tensor descriptor (W1_TMA)."""
    tile, pid_n = _swizzle(tl.program_id(0), NUM_TILES, tl.cdiv(H, BLOCK_N), GROUP_M)
    e, rows, rmask = _tile_rows(tile, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, BLOCK_M)
    if e < 0:
        return
    tok = tl.load(expert_token_idx_ptr + rows, mask=rmask, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < H
    w_e = w1_ptr + e.to(tl.int64) * stride_we
    omask = rmask[:, None] & nmask[None, :]
    if GATED:
        if TWO_DOTS:
            gate, up = _gate_up_dot(x_ptr, tok, rmask, stride_xl, stride_xd, w_e, stride_wf, stride_wd, offs_n,
                                    nmask, D, H, w1_desc, e * 2 * H, W1_TMA, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        else:
            # One (BLOCK_K, 2·BLOCK_N) weight tile holds the gate and up rows interleaved (column 2j: gate
            # row n+j, column 2j+1: up row H+n+j), so a single wide MMA serves both; split afterwards.
            j = tl.arange(0, 2 * BLOCK_N)
            w_rows = (j % 2) * H + pid_n * BLOCK_N + j // 2
            acc = _rows_dot(x_ptr, tok, rmask, stride_xl, stride_xd, w_e, stride_wd, stride_wf, w_rows,
                            (pid_n * BLOCK_N + j // 2) < H, D, x_ptr, w_e, 0, False, False, False,
                            BLOCK_M, 2 * BLOCK_N, BLOCK_K, PRECISION)
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        if STORE_PREACT:
            p_ptrs = _row_ptrs(preact_ptr, rows, stride_pl, offs_n)
            tl.store(p_ptrs, gate.to(preact_ptr.dtype.element_ty), mask=omask)
            tl.store(p_ptrs + H, up.to(preact_ptr.dtype.element_ty), mask=omask)
        if STORE_ACT:
            out = _act(gate, ACT) * up
            tl.store(_row_ptrs(act_ptr, rows, stride_al, offs_n), out.to(act_ptr.dtype.element_ty), mask=omask)
    else:
        gate = _rows_dot(x_ptr, tok, rmask, stride_xl, stride_xd, w_e, stride_wd, stride_wf, offs_n, nmask, D,
                         x_ptr, w1_desc, e * H, False, W1_TMA, True, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        if STORE_PREACT:
            tl.store(_row_ptrs(preact_ptr, rows, stride_pl, offs_n), gate.to(preact_ptr.dtype.element_ty),
                     mask=omask)
        if STORE_ACT:
            tl.store(_row_ptrs(act_ptr, rows, stride_al, offs_n), _act(gate, ACT).to(act_ptr.dtype.element_ty),
                     mask=omask)


@triton.autotune(configs=ROWS_CONFIGS, key=["N", "K_DIM"])
@triton.jit
def _expert_rows_kernel(
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
def _load_h(preact_ptr, rows, rmask, col0, H, stride_pl, GATED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The saved pre-activation (gate, up) of rows x columns col0 .. col0+BLOCK_N (up is gate if not GATED)."""
    offs_n = col0 + tl.arange(0, BLOCK_N)
    mask = rmask[:, None] & (offs_n < H)[None, :]
    ptrs = _row_ptrs(preact_ptr, rows, stride_pl, offs_n)
    g = tl.load(ptrs, mask=mask, other=0.0)
    if GATED:
        return g, tl.load(ptrs + H, mask=mask, other=0.0)
    return g, g


@triton.jit
def _load_h_halves(preact_ptr, rows, rmask, col0, H, stride_pl, GATED: tl.constexpr, HALF: tl.constexpr,
                   EPI_SPLIT: tl.constexpr):
    """(g0, u0, g1, u1): H of the tile's first HALF columns and, when EPI_SPLIT == 2, of its second."""
    g0, u0 = _load_h(preact_ptr, rows, rmask, col0, H, stride_pl, GATED, HALF)
    if EPI_SPLIT == 2:
        g1, u1 = _load_h(preact_ptr, rows, rmask, col0 + HALF, H, stride_pl, GATED, HALF)
        return g0, u0, g1, u1
    return g0, u0, g0, u0


@triton.jit
def _store_dh_and_sa(dact, g, u, s, rows, cols, dpreact_ptr, act_scaled_ptr, stride_pl, stride_al, H, mask,
                     GATED: tl.constexpr, ACT: tl.constexpr):
    """From dA' (fp32) of rows x cols, H there (g; u too if GATED) and the rows' router weights s: stores
    dH = d act(s * dA') into dpreact (the up columns H further on) and s * A into act_scaled; returns A
    (fp32), for dS. The s * A addresses are formed at their store (held across the dH math, they cost
    the fused dH kernel ~90 B more of spills per thread, sm_90, triton 3.6)."""
    g = g.to(tl.float32)
    dp_ptrs = _row_ptrs(dpreact_ptr, rows, stride_pl, cols)
    if GATED:
        u = u.to(tl.float32)
        act_g = _act(g, ACT)
        a = act_g * u
        das = dact * s[:, None]
        tl.store(dp_ptrs, (das * u * _act_grad(g, ACT)).to(dpreact_ptr.dtype.element_ty), mask=mask)
        tl.store(dp_ptrs + H, (das * act_g).to(dpreact_ptr.dtype.element_ty), mask=mask)
    else:
        a = _act(g, ACT)
        tl.store(dp_ptrs, (dact * s[:, None] * _act_grad(g, ACT)).to(dpreact_ptr.dtype.element_ty), mask=mask)
    tl.store(_row_ptrs(act_scaled_ptr, rows, stride_al, cols), (a * s[:, None]).to(act_scaled_ptr.dtype.element_ty),
             mask=mask)
    return a


@triton.jit
def _dh_epilogue(dact, col0, rows, rmask, g, u, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr, H, LK,
                 stride_pl, stride_al, GATED: tl.constexpr, ACT: tl.constexpr, DS_BLOCK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dH epilogue of columns col0 .. col0+BLOCK_N of dA', given H there (g, u)."""
    offs_n = col0 + tl.arange(0, BLOCK_N)
    omask = rmask[:, None] & (offs_n < H)[None, :]
    g = g.to(tl.float32)  # before the router weights' load, as before the helper: ptxas then spills no more
    s = tl.load(w_sorted_ptr + rows, mask=rmask, other=0.0)
    a = _store_dh_and_sa(dact, g, u, s, rows, offs_n, dpreact_ptr, act_scaled_ptr, stride_pl, stride_al, H, omask,
                         GATED, ACT)
    R: tl.constexpr = BLOCK_N // DS_BLOCK
    ds = tl.sum(tl.reshape(dact * a, (BLOCK_M, R, DS_BLOCK)), axis=2)  # (BLOCK_M, R)
    slot = col0 // DS_BLOCK + tl.arange(0, R)
    row0 = tl.min(rows)
    tl.store((ds_part_ptr + row0 + slot.to(tl.int64) * LK)[None, :] + (rows - row0)[:, None], ds,
             mask=rmask[:, None] & (slot * DS_BLOCK < H)[None, :])


@triton.jit
def _act_bwd_kernel(dact_ptr, preact_ptr, expert_token_idx_ptr, token_slot_ptr, topk_w_ptr, dpreact_ptr,
                    act_scaled_ptr, dtopk_w_ptr, LK, H, stride_dl, stride_pl, stride_al, K: tl.constexpr,
                    GATED: tl.constexpr, ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """The dH epilogue as a pass of its own over BLOCK_R rows, for a dA' = dy[token] @ W2[e] computed
    apart (the Hopper path): from dA' and H, dH = d act(s * dA'), s * A, and dS[r] = <dA'[r], A[r]>
    whole (no partials), stored straight into the router-weight gradient (L, K) in its dtype. A row r of
    token t is the pair (t, k) with token_slot[t, k] == r: its weight is read from topk_w there and its
    dS stored there, so no row-order copy of the weights exists. dpreact may be preact and act_scaled
    may be dact: each element is read before it is written, by the same thread."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < LK
    pair0 = tl.load(expert_token_idx_ptr + rows, mask=rmask, other=0) * K
    pair = pair0
    for k in tl.static_range(K):
        pair = tl.where(tl.load(token_slot_ptr + pair0 + k, mask=rmask, other=-1) == rows, pair0 + k, pair)
    s = tl.load(topk_w_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
    ds = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, H, BLOCK_H):
        cols = c0 + tl.arange(0, BLOCK_H)
        mask = rmask[:, None] & (cols < H)[None, :]
        da = tl.load(_row_ptrs(dact_ptr, rows, stride_dl, cols), mask=mask, other=0.0).to(tl.float32)
        g, u = _load_h(preact_ptr, rows, rmask, c0, H, stride_pl, GATED, BLOCK_H)
        a = _store_dh_and_sa(da, g, u, s, rows, cols, dpreact_ptr, act_scaled_ptr, stride_pl, stride_al, H, mask,
                             GATED, ACT)
        ds += tl.sum(da * a, axis=1)
    tl.store(dtopk_w_ptr + pair, ds.to(dtopk_w_ptr.dtype.element_ty), mask=rmask)


# restore_value: under checkpoint="recompute" the kernel writes dH over the H it reads, so the tuner's
# repeated trial launches must each start from the original H.
@triton.autotune(configs=DH_CONFIGS, key=["D", "H", "GATED"], restore_value=["preact_ptr"])
@triton.jit
def _expert_down_bwd_kernel(
    dy_ptr, w2_ptr, w2_desc, preact_ptr, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr,
    expert_token_idx_ptr, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
    NUM_TILES, D, H, LK, stride_dyl, stride_dyd, stride_we, stride_wd, stride_wh, stride_pl, stride_al,
    GATED: tl.constexpr, ACT: tl.constexpr, DS_BLOCK: tl.constexpr, PREFETCH_H: tl.constexpr,
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
        g0, u0, g1, u1 = _load_h_halves(preact_ptr, rows, rmask, col0, H, stride_pl, GATED, HALF, PARTS)
    dact = _rows_dot(dy_ptr, tok, rmask, stride_dyl, stride_dyd, w2_ptr + e.to(tl.int64) * stride_we, stride_wd,
                     stride_wh, offs_n, offs_n < H, D, dy_ptr, w2_desc, e * D, False, W2_TMA, False,
                     BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    if not PREFETCH_H:
        g0, u0, g1, u1 = _load_h_halves(preact_ptr, rows, rmask, col0, H, stride_pl, GATED, HALF, PARTS)
    if EPI_SPLIT == 1:
        _dh_epilogue(dact, col0, rows, rmask, g0, u0, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr, H, LK,
                     stride_pl, stride_al, GATED, ACT, DS_BLOCK, BLOCK_M, BLOCK_N)
    elif EPI_SPLIT == 4:
        # quarters of Q columns: column i·2Q + j·Q + q sits at [q, i, j] after the permute
        Q: tl.constexpr = BLOCK_N // 4
        lo, hi = tl.split(tl.permute(tl.reshape(dact, (BLOCK_M, 2, 2, Q)), (0, 3, 1, 2)))
        d0, d2 = tl.split(lo)
        d1, d3 = tl.split(hi)
        _dh_epilogue(d0, col0, rows, rmask, g0, u0, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr, H, LK,
                     stride_pl, stride_al, GATED, ACT, DS_BLOCK, BLOCK_M, Q)
        _dh_epilogue(d1, col0 + Q, rows, rmask, g1, u1, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr, H,
                     LK, stride_pl, stride_al, GATED, ACT, DS_BLOCK, BLOCK_M, Q)
        g2, u2, g3, u3 = _load_h_halves(preact_ptr, rows, rmask, col0 + 2 * Q, H, stride_pl, GATED, Q, 2)
        _dh_epilogue(d2, col0 + 2 * Q, rows, rmask, g2, u2, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr,
                     H, LK, stride_pl, stride_al, GATED, ACT, DS_BLOCK, BLOCK_M, Q)
        _dh_epilogue(d3, col0 + 3 * Q, rows, rmask, g3, u3, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr,
                     H, LK, stride_pl, stride_al, GATED, ACT, DS_BLOCK, BLOCK_M, Q)
    else:
        d0, d1 = tl.split(tl.permute(tl.reshape(dact, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        _dh_epilogue(d0, col0, rows, rmask, g0, u0, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr, H, LK,
                     stride_pl, stride_al, GATED, ACT, DS_BLOCK, BLOCK_M, HALF)
        _dh_epilogue(d1, col0 + HALF, rows, rmask, g1, u1, w_sorted_ptr, dpreact_ptr, act_scaled_ptr, ds_part_ptr,
                     H, LK, stride_pl, stride_al, GATED, ACT, DS_BLOCK, BLOCK_M, HALF)


@triton.autotune(configs=WGRAD_CONFIGS, key=["N", "P", "GATHER_P", "GATHER_Q"])
@triton.jit
def _expert_weight_grad_kernel(
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


@triton.jit
def _combine_kernel(rows_ptr, token_slot_ptr, weights_ptr, out_ptr, L, D, stride_rl, stride_ol,
                    K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum_k (w[t, k] *) rows[token_slot[t, k]]: each token gathers its K rows, in fixed order,
    accumulated in fp32 (no atomics: deterministic)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = t < L
    mask = tmask[:, None] & (cols < D)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
        slot = tl.load(token_slot_ptr + t * K + k, mask=tmask, other=0).to(tl.int64)
        r = tl.load(rows_ptr + slot[:, None] * stride_rl + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            r = r * tl.load(weights_ptr + t * K + k, mask=tmask, other=0.0)[:, None]
        acc += r
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_ol + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _tile_schedule_kernel(counts_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, used_ptr, E, MAX_TILES,
                          BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, BLOCK_T: tl.constexpr):
    """The row-tile schedule of the expert kernels: for tile ids t < MAX_TILES, the expert whose rows
    tile t covers (tiles of BLOCK_M rows, expert by expert; -1 past the last used tile) and its first
    row; program 0 also writes the number of used tiles. Each program rebuilds the per-expert tile
    prefix sum from the E counts (E_POW2 >= E) and finds its tiles' experts by comparison."""
    ex = tl.arange(0, E_POW2)
    n_tiles = (tl.load(counts_ptr + ex, mask=ex < E, other=0) + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(n_tiles, 0)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), 1)  # experts whose tiles all lie before t
    valid = e < E
    first_tile = tl.sum(tl.where(ex[None, :] == e[:, None], tile_end - n_tiles, 0), 1)
    row = tl.load(offsets_ptr + e, mask=valid, other=0) + (t - first_tile) * BLOCK_M
    tmask = t < MAX_TILES
    tl.store(tile_expert_ptr + t, tl.where(valid, e, -1), mask=tmask)
    tl.store(tile_row_ptr + t, tl.where(valid, row, 0), mask=tmask)
    one = tl.arange(0, 1)
    tl.store(used_ptr + one, tl.sum(n_tiles, 0) + one, mask=one + tl.program_id(0) == 0)


TUNED_KERNELS = {"up": _expert_up_fwd_kernel, "rows": _expert_rows_kernel, "dH": _expert_down_bwd_kernel,
                 "weight_grad": _expert_weight_grad_kernel}
