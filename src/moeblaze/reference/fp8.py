"""FP8 (e4m3) quantization as DeepSeek-V3 scales it, in plain PyTorch: the reference every fp8 path is checked against.

  rows    one fp32 scale per 1 x 128 group along the last dimension (activations, gradients, a kept pre-activation)
  blocks  one fp32 scale per 128 x 128 block of a matrix's last two dimensions (weights)

A group's scale is amax / 448 (e4m3's largest finite value; computed as amax times 1/448 in fp32, so that every
device rounds it alike), so its largest magnitude maps to ±448 (within an ulp); values are multiplied by the
scale's fp32 reciprocal (1 / scale rounded once: one division a group, not one an element, in the kernels too),
clamped to ±448 (a saturating cast) and cast to torch.float8_e4m3fn; the value a kernel sees is q · scale. An
all-zero group (a padding row, an empty expert's slot) gets the scale AMAX_FLOOR / 448 instead of 0, so no scale is
0 and its reciprocal is finite: its values quantize to 0. A last group narrower than 128 (a width that is not a
multiple of 128) is scaled on its own. Non-finite inputs are not supported (the amax, and so the group, turns NaN).

fake_quant_rows / fake_quant_blocks give q · scale in fp32 (the emulated value, what a kernel's GEMM multiplies), so a
kernel's error can be told apart from the format's. Memory: the fp8 tensor is one byte per element, its scales 4 bytes
per 128 elements (rows) or per 128² (blocks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
GROUP = 128
AMAX_FLOOR = 1e-12  # the amax an all-zero group is scaled by


def _groups(n: int) -> int:
    return -(-n // GROUP)


INV_FP8_MAX = float(torch.tensor(1 / FP8_MAX, dtype=torch.float32))  # 1/448 as fp32 holds it, exactly


def _scale(amax: torch.Tensor) -> torch.Tensor:
    # times the fp32 reciprocal, not / 448: torch divides by a scalar through its reciprocal on CUDA and exactly on
    # the CPU, while one fp32 multiply rounds the same everywhere (the kernels do the same multiply)
    return amax.clamp(min=AMAX_FLOOR) * INV_FP8_MAX


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 t, scales (..., ceil(n / 128)) fp32) for t (..., n): one scale per 1 x 128 group of the last dimension."""
    n = t.shape[-1]
    g = F.pad(t.float(), (0, _groups(n) * GROUP - n)).unflatten(-1, (_groups(n), GROUP))
    scale = _scale(g.abs().amax(-1))
    q = (g * torch.reciprocal(scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2)[..., :n]
    return q.contiguous(), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q · scale for quantize_rows's pair, in dtype."""
    n = q.shape[-1]
    return (q.float() * scale.repeat_interleave(GROUP, dim=-1)[..., :n]).to(dtype)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 w, scales (..., ceil(m / 128), ceil(n / 128)) fp32) for w (..., m, n): one scale per 128 x 128 block."""
    m, n = w.shape[-2:]
    g = F.pad(w.float(), (0, _groups(n) * GROUP - n, 0, _groups(m) * GROUP - m))
    g = g.unflatten(-1, (_groups(n), GROUP)).unflatten(-3, (_groups(m), GROUP))  # (..., M/128, 128, N/128, 128)
    scale = _scale(g.abs().amax((-3, -1)))
    q = (g * torch.reciprocal(scale)[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-2).flatten(-3, -2)[..., :m, :n].contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q · scale for quantize_blocks's pair, in dtype."""
    m, n = q.shape[-2:]
    s = scale.repeat_interleave(GROUP, dim=-2).repeat_interleave(GROUP, dim=-1)[..., :m, :n]
    return (q.float() * s).to(dtype)


def fake_quant_rows(t: torch.Tensor) -> torch.Tensor:
    """t through e4m3 with 1 x 128 scales and back, in fp32."""
    return dequantize_rows(*quantize_rows(t))


def fake_quant_blocks(w: torch.Tensor) -> torch.Tensor:
    """w through e4m3 with 128 x 128 scales and back, in fp32."""
    return dequantize_blocks(*quantize_blocks(w))
