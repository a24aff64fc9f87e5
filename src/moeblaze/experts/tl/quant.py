"""The fp8 quantizers as single-pass kernels: reference.fp8's arithmetic (amax per group, scale = max(amax,
AMAX_FLOOR) / 448, q = clamp(v / scale, ±448) cast to e4m3), one read of the input and one write of q and
its scales, where the torch passes of the reference make six.

  quantize_rows     t (R, n) -> q (R, n), scales (R, ceil(n / 128)): 1 x 128 groups (x, dy, dH, a kept H)
  swiglu_quantize   H (R, 2h) -> q(SiLU(gate) * up) (R, h) and its 1 x 128 scales: the down-projection's
                    operand straight from H (gate columns first, or interleaved), A never stored in bf16
  dequantize_rows   (q, scales) -> q · scale in a given dtype (backward's read of a kept H)
  quantize_blocks   W (E, N, K) -> q (E, N, K), scales (E, ceil(N / 128), ceil(K / 128)): 128 x 128 blocks;
                    transpose=True writes q(W)ᵀ (E, K, N) and its scales (E, ceil(K / 128), ceil(N / 128)),
                    the K-major operand backward's GEMMs need (square blocks: quantize_blocks(Wᵀ) exactly)

Values equal reference.fp8's bit for bit on the GPU: the scale is amax times fp32's 1/448, v / scale is rounded
to nearest (which Triton's `/` is not), and e4m3's cast saturates. swiglu_quantize rounds A to H's dtype first, as
the unfused path stores it, with SiLU in fp32. Triton's interpreter casts to e4m3 wrongly where rounding carries
into the exponent (125.9 gives 64), so under it the kernels round in fp32 arithmetic first (_round_e4m3); the cast
of a value e4m3 holds exactly is right there.

Memory: the outputs only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...config import INTERPRET
from ...launch import launch
from ...reference.fp8 import AMAX_FLOOR, FP8, FP8_MAX, GROUP, INV_FP8_MAX

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
    scale = tl.maximum(tl.max(tl.abs(v), axis=1), AMAX_FLOOR) * INV_FP8_MAX
    y = tl.minimum(tl.maximum(tl.math.div_rn(v, scale[:, None]), -FP8_MAX), FP8_MAX)
    if EMULATE:
        y = _round_e4m3(y)
    tl.store(q_ptrs, y.to(q_ptrs.dtype.element_ty), mask=mask)
    tl.store(s_ptrs, scale, mask=smask)


@triton.jit
def _rows_kernel(t_ptr, q_ptr, s_ptr, R, N, stride_t, stride_q, stride_s, SWIGLU: tl.constexpr,
                 INTERLEAVED: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                 INV_FP8_MAX: tl.constexpr, FP8_MAX: tl.constexpr, EMULATE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    rmask = rows < R
    mask = rmask[:, None] & (cols < N)[None, :]
    src = t_ptr + rows.to(tl.int64)[:, None] * stride_t
    if SWIGLU:  # N is h: gate and up of column j at j and N + j, or at 2j and 2j + 1 (interleaved)
        if INTERLEAVED:
            gate = tl.load(src + 2 * cols[None, :], mask=mask, other=0.0).to(tl.float32)
            up = tl.load(src + 2 * cols[None, :] + 1, mask=mask, other=0.0)
        else:
            gate = tl.load(src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            up = tl.load(src + N + cols[None, :], mask=mask, other=0.0)
        a = (gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up  # SiLU(gate) in H's dtype, times up, as torch
        v = a.to(up.dtype).to(tl.float32)
    else:
        v = tl.load(src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q = q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :]
    _quantize(v, mask, q, s_ptr + rows.to(tl.int64) * stride_s + g, rmask, AMAX_FLOOR, INV_FP8_MAX, FP8_MAX,
              EMULATE)


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
                   TRANSPOSE: tl.constexpr, GROUP: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                   INV_FP8_MAX: tl.constexpr, FP8_MAX: tl.constexpr, EMULATE: tl.constexpr):
    e = tl.program_id(2).to(tl.int64)
    bn, bk = tl.program_id(0), tl.program_id(1)
    n = bn * GROUP + tl.arange(0, GROUP)
    k = bk * GROUP + tl.arange(0, GROUP)
    mask = (n < N)[:, None] & (k < K)[None, :]
    v = tl.load(w_ptr + e * stride_we + n.to(tl.int64)[:, None] * stride_wn + k[None, :], mask=mask,
                other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.max(tl.abs(v), axis=1), axis=0), AMAX_FLOOR) * INV_FP8_MAX
    y = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FP8_MAX), FP8_MAX)
    if EMULATE:
        y = _round_e4m3(y)
    if TRANSPOSE:  # q(W)ᵀ: row k, column n; the tile transposed in registers, so that the stores run along n
        q = q_ptr + e * stride_qe + k.to(tl.int64)[:, None] * stride_qr + n[None, :]
        tl.store(q, tl.trans(y).to(q_ptr.dtype.element_ty), mask=(k < K)[:, None] & (n < N)[None, :])
        tl.store(s_ptr + e * stride_se + bk * stride_sr + bn, scale)
    else:
        q = q_ptr + e * stride_qe + n.to(tl.int64)[:, None] * stride_qr + k[None, :]
        tl.store(q, y.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + e * stride_se + bn * stride_sr + bk, scale)


def _groups(n: int) -> int:
    return triton.cdiv(n, GROUP)


def _check(t: torch.Tensor, dims: int, name: str) -> None:
    if t.dim() != dims or t.stride(-1) != 1 or not t.is_floating_point():
        raise ValueError(f"{name}: a floating-point tensor of {dims} dimensions with a contiguous last one "
                         f"expected, got {tuple(t.shape)} {t.dtype} with strides {t.stride()}")


def _rows(t: torch.Tensor, n: int, swiglu: bool, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    R = t.shape[0]
    q = torch.empty(R, n, dtype=FP8, device=t.device)
    s = torch.empty(R, _groups(n), dtype=torch.float32, device=t.device)
    if R and n:
        launch(_rows_kernel, (triton.cdiv(R, ROWS), _groups(n)), t, q, s, R, n, t.stride(0), q.stride(0),
               s.stride(0), SWIGLU=swiglu, INTERLEAVED=interleaved, ROWS=ROWS, GROUP=GROUP, AMAX_FLOOR=AMAX_FLOOR,
               INV_FP8_MAX=INV_FP8_MAX, FP8_MAX=FP8_MAX, EMULATE=INTERPRET, num_warps=4)
    return q, s


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of t (R, n) in 1 x 128 groups: reference.fp8.quantize_rows in one pass."""
    _check(t, 2, "quantize_rows")
    return _rows(t, t.shape[1], False, False)


def swiglu_quantize(preact: torch.Tensor, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of A = SiLU(gate) * up (R, h) from H (R, 2h) in 1 x 128 groups, A never written out."""
    _check(preact, 2, "swiglu_quantize")
    if preact.shape[1] % 2:
        raise ValueError(f"swiglu_quantize: H's width must be even (gate and up), got {preact.shape[1]}")
    return _rows(preact, preact.shape[1] // 2, True, interleaved)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """q · scale (R, n) in dtype for quantize_rows's pair: reference.fp8.dequantize_rows in one pass (into out,
    (R, n) of that dtype with a contiguous last dimension, where given)."""
    R, n = q.shape
    t = torch.empty(R, n, dtype=dtype, device=q.device) if out is None else out
    if R and n:
        launch(_dequant_rows_kernel, (triton.cdiv(R, ROWS), _groups(n)), q, scale, t, R, n, q.stride(0),
               scale.stride(0), t.stride(0), ROWS=ROWS, GROUP=GROUP, num_warps=4)
    return t


def quantize_blocks(w: torch.Tensor, transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of w (E, N, K) in 128 x 128 blocks: reference.fp8.quantize_blocks(w) in one pass, or with
    transpose that of w.transpose(1, 2), written K-major from w as it is."""
    _check(w, 3, "quantize_blocks")
    E, N, K = w.shape
    gn, gk = _groups(N), _groups(K)
    q = torch.empty((E, K, N) if transpose else (E, N, K), dtype=FP8, device=w.device)
    s = torch.empty((E, gk, gn) if transpose else (E, gn, gk), dtype=torch.float32, device=w.device)
    if q.numel():
        launch(_blocks_kernel, (gn, gk, E), w, q, s, N, K, w.stride(0), w.stride(1), q.stride(0), q.stride(1),
               s.stride(0), s.stride(1), TRANSPOSE=transpose, GROUP=GROUP, AMAX_FLOOR=AMAX_FLOOR,
               INV_FP8_MAX=INV_FP8_MAX, FP8_MAX=FP8_MAX, EMULATE=INTERPRET, num_warps=8)
    return q, s
