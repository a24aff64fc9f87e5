"""The fp8 quantizers as single-pass kernels: reference.fp8's arithmetic (amax per group, scale = max(amax,
AMAX_FLOOR) / 448, q = clamp(v · (1 / scale), ±448) cast to e4m3), one read of the input and one write of q and
its scales, where the torch passes of the reference make six.

  quantize_rows     t (R, n) -> q (R, n), scales (R, ceil(n / 128)): 1 x 128 groups (x, dy, dH, a kept H)
  swiglu_quantize   H (R, 2h) -> q(SiLU(gate) * up) (R, h) and its 1 x 128 scales: the down-projection's
                    operand straight from H (gate columns first, or interleaved), A never stored in bf16; and,
                    where asked, quantize_rows(H) from the same read (a kept H under preact-fp8)
  dequantize_rows   (q, scales) -> q · scale in a given dtype (backward's read of a kept H)
  quantize_blocks   W (E, N, K) -> q (E, N, K), scales (E, ceil(N / 128), ceil(K / 128)): 128 x 128 blocks;
                    transpose=True writes q(W)ᵀ (E, K, N) and its scales (E, ceil(K / 128), ceil(N / 128)),
                    the K-major operand backward's GEMMs need (square blocks: quantize_blocks(Wᵀ) exactly);
                    both=True returns the two (experts.fp8's weight cache)

Values equal reference.fp8's bit for bit on the GPU: the scale is amax times fp32's 1/448, its reciprocal is rounded
to nearest once per group (div_rn: Triton's `/` is not), each value is multiplied by it, and e4m3's cast saturates.
swiglu_quantize rounds A to H's dtype first, as the unfused path stores it, with SiLU in fp32. Triton's interpreter
casts to e4m3 wrongly where rounding carries into the exponent (125.9 gives 64), so under it the kernels round in
fp32 arithmetic first (_round_e4m3); the cast of a value e4m3 holds exactly is right there.

Memory: the outputs only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..env import INTERPRET
from ..launch import cdiv, launch
from ..reference.fp8 import AMAX_FLOOR, FP8, FP8_MAX, GROUP, INV_FP8_MAX

ROWS = 32  # rows of a program of the row quantizers


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32: 3 mantissa bits for
    normals (|v| >= 2^-6), multiples of 2^-9 below."""
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer, ties to even
    sub = ((v * 512.0 + magic) - magic) * 0.001953125
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _quantize(v, mask, q_ptrs, s_ptrs, smask, AMAX_FLOOR: tl.constexpr, INV_FP8_MAX: tl.constexpr,
              FP8_MAX: tl.constexpr, EMULATE: tl.constexpr):
    """Stores q and the scale of each row of v (ROWS, GROUP) fp32, one group per row (masked lanes are 0)."""
    v = tl.where(mask, v, 0.0)
    scale = tl.maximum(_nan_max(tl.abs(v), 1), AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL) * INV_FP8_MAX
    _store_scaled(v, _reciprocal(scale)[:, None], mask, q_ptrs, FP8_MAX, EMULATE)
    tl.store(s_ptrs, scale, mask=smask)


@triton.jit
def _rows_kernel(t_ptr, q_ptr, s_ptr, qh_ptr, sh_ptr, R, N, stride_t, stride_q, stride_s, stride_qh, stride_sh,
                 SWIGLU: tl.constexpr, INTERLEAVED: tl.constexpr, KEEP_H: tl.constexpr, ROWS: tl.constexpr,
                 GROUP: tl.constexpr, AMAX_FLOOR: tl.constexpr, INV_FP8_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
                 EMULATE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    rmask = rows < R
    mask = rmask[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)
    src = t_ptr + r64[:, None] * stride_t
    if SWIGLU:  # N is h: gate and up of column j at j and N + j, or at 2j and 2j + 1 (interleaved)
        if INTERLEAVED:
            gate_at = 2 * cols[None, :]
            up_at = 2 * cols[None, :] + 1
        else:
            gate_at = cols[None, :]
            up_at = N + cols[None, :]
        gate = tl.load(src + gate_at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src + up_at, mask=mask, other=0.0)
        a = (gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up  # SiLU(gate) in H's dtype, times up, as torch
        v = a.to(up.dtype).to(tl.float32)
        if KEEP_H:  # H itself in its own 1 x 128 groups, from the values just loaded
            if INTERLEAVED:  # H's groups 2g and 2g + 1: gate and up of this group's first and last 64 columns
                _quantize_gate_up(gate, up.to(tl.float32), mask, qh_ptr + r64[:, None] * stride_qh, cols,
                                  sh_ptr + r64[:, None] * stride_sh, 2 * g, rmask, 2 * N, ROWS, 2, GROUP // 2,
                                  AMAX_FLOOR, INV_FP8_MAX, FP8_MAX, EMULATE)
            else:  # N a multiple of GROUP (checked on the host): gate is H's group g, up its group N / GROUP + g
                qh = qh_ptr + r64[:, None] * stride_qh
                _quantize(gate, mask, qh + gate_at, sh_ptr + r64 * stride_sh + g, rmask, AMAX_FLOOR, INV_FP8_MAX,
                          FP8_MAX, EMULATE)
                _quantize(up.to(tl.float32), mask, qh + up_at, sh_ptr + r64 * stride_sh + N // GROUP + g, rmask,
                          AMAX_FLOOR, INV_FP8_MAX, FP8_MAX, EMULATE)
    else:
        v = tl.load(src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q = q_ptr + r64[:, None] * stride_q + cols[None, :]
    _quantize(v, mask, q, s_ptr + r64 * stride_s + g, rmask, AMAX_FLOOR, INV_FP8_MAX, FP8_MAX, EMULATE)


@triton.jit
def _group_amax(v, ROWS: tl.constexpr, NG: tl.constexpr, PER: tl.constexpr):
    """|v| (ROWS, NG · PER)'s amax over each run of PER columns: (ROWS, NG) fp32."""
    return _nan_max(tl.reshape(tl.abs(v), (ROWS, NG, PER)), 2)


@triton.jit
def _nan_max(a, axis: tl.constexpr):
    """a's max over `axis`, NaN where a NaN is among the values (tl.max drops NaN): a group holding NaN gets a NaN
    scale, so that NaN reaches the GEMM's output as in native precision and in the reference's emulation."""
    return tl.where(tl.max((a != a).to(tl.int32), axis=axis) > 0, float("nan"), tl.max(a, axis=axis))


@triton.jit
def _spread(scale, ROWS: tl.constexpr, NG: tl.constexpr, PER: tl.constexpr):
    """(ROWS, NG) -> (ROWS, NG · PER): each group's value on its PER columns."""
    return tl.reshape(tl.broadcast_to(scale[:, :, None], (ROWS, NG, PER)), (ROWS, NG * PER))


@triton.jit
def _quantize_gate_up(gate, up, mask, q_rows, cols, s_rows, g0, rmask, width, ROWS: tl.constexpr, NG: tl.constexpr,
                      PER: tl.constexpr, AMAX_FLOOR: tl.constexpr, INV_FP8_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
                      EMULATE: tl.constexpr):
    """Interleaved H (or dH) in its own 1 x (2 · PER) groups, from its gate and up parts (ROWS, NG · PER) fp32 of
    pairs cols: group g0 + i holds the gate and up of pairs i · PER .. (i + 1) · PER. q at q_rows' columns 2 · cols
    (gate) and 2 · cols + 1 (up), each group's scale at s_rows' column g0 + i, for groups below width's end (width:
    H's columns); q_rows and s_rows point at the rows (ROWS, 1)."""
    gate = tl.where(mask, gate, 0.0)
    up = tl.where(mask, up, 0.0)
    amax = tl.maximum(_group_amax(gate, ROWS, NG, PER), _group_amax(up, ROWS, NG, PER),
                      propagate_nan=tl.PropagateNan.ALL)
    scale = tl.maximum(amax, AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL) * INV_FP8_MAX
    col_inv = _spread(_reciprocal(scale), ROWS, NG, PER)
    _store_scaled(gate, col_inv, mask, q_rows + 2 * cols[None, :], FP8_MAX, EMULATE)
    _store_scaled(up, col_inv, mask, q_rows + 2 * cols[None, :] + 1, FP8_MAX, EMULATE)
    groups = g0 + tl.arange(0, NG)
    tl.store(s_rows + groups[None, :], scale, mask=rmask[:, None] & (groups * 2 * PER < width)[None, :])


@triton.jit
def _reciprocal(scale):
    """1 / scale rounded to nearest (what a group's values are multiplied by)."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _saturate(y, FP8_MAX: tl.constexpr):
    """y clamped to ±FP8_MAX, NaN kept (Triton's minimum and maximum drop a NaN operand by default)."""
    return tl.minimum(tl.maximum(y, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _store_scaled(v, inv_scale, mask, q_ptrs, FP8_MAX: tl.constexpr, EMULATE: tl.constexpr):
    """q = v · inv_scale (the scale's reciprocal), saturated and cast to e4m3 (v and inv_scale of one shape); a NaN
    or infinite value stays NaN (e4m3fn has no infinity), so that it reaches the output as in native precision."""
    y = _saturate(v * inv_scale, FP8_MAX)
    if EMULATE:
        y = _round_e4m3(y)
    tl.store(q_ptrs, y.to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_rows_kernel(q_ptr, s_ptr, t_ptr, R, N, stride_q, stride_s, stride_t, ROWS: tl.constexpr,
                         GROUP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    rmask = rows < R
    mask = rmask[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)
    q = tl.load(q_ptr + r64[:, None] * stride_q + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(s_ptr + r64 * stride_s + g, mask=rmask, other=0.0)
    tl.store(t_ptr + r64[:, None] * stride_t + cols[None, :], (q * scale[:, None]).to(t_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _blocks_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_we, stride_wn, stride_qe, stride_qr, stride_se, stride_sr,
                   TRANSPOSE: tl.constexpr, WIDE: tl.constexpr, GROUP: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                   INV_FP8_MAX: tl.constexpr, FP8_MAX: tl.constexpr, EMULATE: tl.constexpr):
    """One 128 x 128 block of W: q(W) into q, or with TRANSPOSE q(W)ᵀ. Addresses are one 64-bit base per expert and
    32-bit offsets within it (WIDE: 64-bit offsets, for an expert's matrix of 2^31 elements or more)."""
    e = tl.program_id(2).to(tl.int64)
    bn, bk = tl.program_id(0), tl.program_id(1)
    n = bn * GROUP + tl.arange(0, GROUP)
    k = bk * GROUP + tl.arange(0, GROUP)
    if WIDE:
        n = n.to(tl.int64)
        k = k.to(tl.int64)
    mask = (n < N)[:, None] & (k < K)[None, :]
    v = tl.load(w_ptr + e * stride_we + (n[:, None] * stride_wn + k[None, :]), mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(_nan_max(_nan_max(tl.abs(v), 1), 0), AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL) * INV_FP8_MAX
    y = _saturate(v * _reciprocal(scale), FP8_MAX)
    if EMULATE:
        y = _round_e4m3(y)
    y = y.to(q_ptr.dtype.element_ty)
    if TRANSPOSE:  # q(W)ᵀ: row k, column n; the tile transposed in registers, so that the stores run along n
        tl.store(q_ptr + e * stride_qe + (k[:, None] * stride_qr + n[None, :]), tl.trans(y),
                 mask=(k < K)[:, None] & (n < N)[None, :])
        tl.store(s_ptr + e * stride_se + bk * stride_sr + bn, scale)
    else:
        tl.store(q_ptr + e * stride_qe + (n[:, None] * stride_qr + k[None, :]), y, mask=mask)
        tl.store(s_ptr + e * stride_se + bn * stride_sr + bk, scale)


def _groups(n: int) -> int:
    return cdiv(n, GROUP)


def _check(t: torch.Tensor, dims: int, name: str) -> None:
    if t.dim() != dims or t.stride(-1) != 1 or not t.is_floating_point():
        raise ValueError(f"{name}: a floating-point tensor of {dims} dimensions with a contiguous last one "
                         f"expected, got {tuple(t.shape)} {t.dtype} with strides {t.stride()}")


def _rows(t: torch.Tensor, n: int, swiglu: bool, interleaved: bool, keep_h: bool = False):
    R = t.shape[0]
    q = torch.empty(R, n, dtype=FP8, device=t.device)
    s = torch.empty(R, _groups(n), dtype=torch.float32, device=t.device)
    qh = torch.empty(R, t.shape[1] if keep_h else 0, dtype=FP8, device=t.device)
    sh = torch.empty(R, _groups(qh.shape[1]), dtype=torch.float32, device=t.device)
    if R and n:
        # keep_h at 4 warps: 124-134 registers a thread (12 warps a multiprocessor), 2.2-2.7 TB/s on an H200
        # against 3.3-3.8 without it; at 8 warps, 72-80
        launch(_rows_kernel, (cdiv(R, ROWS), _groups(n)), t, q, s, qh, sh, R, n, t.stride(0), q.stride(0),
               s.stride(0), max(qh.stride(0), 1), max(sh.stride(0), 1), SWIGLU=swiglu, INTERLEAVED=interleaved,
               KEEP_H=keep_h, ROWS=ROWS, GROUP=GROUP, AMAX_FLOOR=AMAX_FLOOR, INV_FP8_MAX=INV_FP8_MAX,
               FP8_MAX=FP8_MAX, EMULATE=INTERPRET, num_warps=8 if keep_h else 4)
    return ((q, s), (qh, sh)) if keep_h else (q, s)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of t (R, n) in 1 x 128 groups: reference.fp8.quantize_rows in one pass."""
    _check(t, 2, "quantize_rows")
    return _rows(t, t.shape[1], False, False)


def swiglu_quantize(preact: torch.Tensor, interleaved: bool = False, keep_preact: bool = False):
    """(q, scales) of A = SiLU(gate) * up (R, h) from H (R, 2h) in 1 x 128 groups, A never written out; with
    keep_preact, ((q, scales) of A, quantize_rows(H)) from the same read of H (checkpoint="preact-fp8" under
    precision="fp8"), where H's groups fall on gate's and up's (interleaved, or h a multiple of 128), else
    quantize_rows(H) as a pass of its own."""
    _check(preact, 2, "swiglu_quantize")
    if preact.shape[1] % 2:
        raise ValueError(f"swiglu_quantize: H's width must be even (gate and up), got {preact.shape[1]}")
    h = preact.shape[1] // 2
    if keep_preact and not (interleaved or h % GROUP == 0):
        return _rows(preact, h, True, interleaved), quantize_rows(preact)
    return _rows(preact, h, True, interleaved, keep_preact)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """q · scale (R, n) in dtype for quantize_rows's pair: reference.fp8.dequantize_rows in one pass (into out,
    (R, n) of that dtype with a contiguous last dimension, where given)."""
    R, n = q.shape
    t = torch.empty(R, n, dtype=dtype, device=q.device) if out is None else out
    if R and n:
        launch(_dequant_rows_kernel, (cdiv(R, ROWS), _groups(n)), q, scale, t, R, n, q.stride(0),
               scale.stride(0), t.stride(0), ROWS=ROWS, GROUP=GROUP, num_warps=4)
    return t


def quantize_blocks(w: torch.Tensor, transpose: bool = False, both: bool = False):
    """(q, scales) of w (E, N, K) in 128 x 128 blocks: reference.fp8.quantize_blocks(w) in one pass, or with
    transpose that of w.transpose(1, 2), written K-major from w as it is; with both, the two pairs, one launch
    each: ((q, scales) of w, (q, scales) of w.transpose(1, 2)). (One kernel writing both from one read ran at
    2.5 TB/s on an H200, where each layout alone runs at 4.3: two launches take 0.88x its time.)"""
    _check(w, 3, "quantize_blocks")
    if transpose and both:
        raise ValueError("quantize_blocks: transpose and both are exclusive (both returns the transposed pair too)")
    if both:
        return _blocks(w, False), _blocks(w, True)
    return _blocks(w, transpose)


def _blocks(w: torch.Tensor, transpose: bool):
    E, N, K = w.shape
    gn, gk = _groups(N), _groups(K)
    q = torch.empty((E, K, N) if transpose else (E, N, K), dtype=FP8, device=w.device)
    s = torch.empty((E, gk, gn) if transpose else (E, gn, gk), dtype=torch.float32, device=w.device)
    wide = max(w.stride(1) * N, q.stride(1) * q.shape[1]) >= 2 ** 31
    if q.numel():
        launch(_blocks_kernel, (gn, gk, E), w, q, s, N, K, w.stride(0), w.stride(1), q.stride(0), q.stride(1),
               s.stride(0), s.stride(1), TRANSPOSE=transpose, WIDE=wide, GROUP=GROUP, AMAX_FLOOR=AMAX_FLOOR,
               INV_FP8_MAX=INV_FP8_MAX, FP8_MAX=FP8_MAX, EMULATE=INTERPRET, num_warps=8)
    return q, s
