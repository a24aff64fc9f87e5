"""The one-pass fp8 quantizers (experts.quant, interpreter) against reference.fp8 bit for bit: random values,
zero rows, outliers, values past 448, ragged last groups, every value e4m3 can round to; SwiGLU fused in."""
import pytest
import torch

from moeblaze.experts import quant
from moeblaze.reference import FP8_MAX, apply_activation, dequantize_rows, quantize_blocks, quantize_rows


def _same(got, want):
    """Quantizer outputs equal bit for bit (q as the values e4m3 holds, scales exactly)."""
    (q, s), (rq, rs) = got, want
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == rq.shape and s.shape == rs.shape
    assert torch.equal(s, rs)
    assert torch.equal(q.float(), rq.float()), (q.float() - rq.float()).abs().max()


def _hard_rows(R, n, dtype, gen):
    t = torch.randn(R, n, generator=gen) * torch.logspace(-3, 3, R)[:, None]
    t[1] = 0  # a zero row: its scale is the floor, its values 0
    t[2, 5] = 1e4  # an outlier: its group alone scales to it
    t[3, :] = torch.randn(n, generator=gen) * 1e-8  # tiny values: scaled up to 448 like any others
    t[4, 0] = 1e-9  # one tiny value beside ordinary ones: an e4m3 subnormal or 0 once scaled
    return t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [128, 300, 40])
def test_quantize_rows_is_the_references(poison_alloc, dtype, n):
    gen = torch.Generator().manual_seed(n)
    t = _hard_rows(37, n, dtype, gen)
    _same(quant.quantize_rows(t), quantize_rows(t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_rows_is_the_references(poison_alloc, dtype):
    q, s = quantize_rows(_hard_rows(21, 300, torch.float32, torch.Generator().manual_seed(1)))
    assert torch.equal(quant.dequantize_rows(q, s, dtype), dequantize_rows(q, s, dtype))


def test_rounding_covers_every_e4m3_value_and_the_ties_between_them():
    """Every finite e4m3 magnitude, the midpoints between neighbours (ties go to even) and points just off them,
    scaled so that one group's amax is exactly 448: q equals torch's cast."""
    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (vals[1:] + vals[:-1]) / 2
    pts = torch.cat([vals, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20)])
    pts = torch.cat([pts, -pts, torch.tensor([FP8_MAX])])
    n = pts.numel()
    t = pts[None, :].repeat(2, 1)
    t[1] *= -1
    # groups of 128 each need their own amax at 448 to keep the values unscaled: put 448 in each group
    groups = -(-n // 128)
    t = torch.nn.functional.pad(t, (0, groups * 128 - n)).unflatten(1, (groups, 128))
    t[:, :, 0] = FP8_MAX
    t = t.flatten(1)
    q, s = quant.quantize_rows(t)
    assert torch.equal(s, torch.ones_like(s))
    assert torch.equal(q.float(), t.to(torch.float8_e4m3fn).float())


def test_values_past_448_saturate_in_the_kernel():
    t = torch.tensor([[1.0, -1.0] * 64])
    t[0, 0], t[0, 1] = 1e30, -1e30  # scale 1e30 / 448: the rest quantize to 0, nothing to inf or NaN
    q, s = quant.quantize_rows(t)
    assert q.float()[0, 0] == FP8_MAX and q.float()[0, 1] == -FP8_MAX and torch.isfinite(q.float()).all()
    _same((q, s), quantize_rows(t))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("h", [128, 200])
def test_swiglu_quantize_is_the_activation_then_the_quantizer(poison_alloc, interleaved, h):
    gen = torch.Generator().manual_seed(h + interleaved)
    preact = (torch.randn(29, 2 * h, generator=gen) * 3).half()
    q, s = quant.swiglu_quantize(preact, interleaved)
    # SiLU in fp32 then fp16, times up in fp16: the unfused path's torch arithmetic (its exp is numpy's here)
    _same((q, s), quantize_rows(apply_activation(preact, "swiglu", interleaved)))


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("shape", [(3, 256, 128), (2, 200, 300)])
def test_quantize_blocks_is_the_references(poison_alloc, transpose, shape):
    gen = torch.Generator().manual_seed(sum(shape) + transpose)
    w = torch.randn(*shape, generator=gen) * torch.logspace(-2, 2, shape[0])[:, None, None]
    w[0, :128, :128] = 0  # a zero block
    w[-1, 7, 9] = 500.0  # an outlier: its block alone
    w = w.half()
    want = quantize_blocks(w.transpose(1, 2).contiguous() if transpose else w)
    _same(quant.quantize_blocks(w, transpose), want)


@pytest.mark.parametrize("shape", [(3, 256, 128), (2, 200, 300)])
def test_quantize_blocks_both_is_the_two_passes(poison_alloc, shape):
    """both=True: quantize_blocks(w) and quantize_blocks(w, transpose=True) from one read, bit for bit."""
    gen = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(*shape, generator=gen) * torch.logspace(-2, 2, shape[0])[:, None, None]).half()
    w[-1, 7, 9] = 500.0
    got, got_t = quant.quantize_blocks(w, both=True)
    _same(got, quantize_blocks(w))
    _same(got_t, quantize_blocks(w.transpose(1, 2).contiguous()))


def test_quantizers_refuse_bad_operands():
    with pytest.raises(ValueError, match="contiguous last"):
        quant.quantize_rows(torch.randn(8, 128).t())
    with pytest.raises(ValueError, match="even"):
        quant.swiglu_quantize(torch.randn(8, 127))
    with pytest.raises(ValueError, match="3 dimensions"):
        quant.quantize_blocks(torch.randn(128, 128))
    with pytest.raises(ValueError, match="exclusive"):
        quant.quantize_blocks(torch.randn(1, 128, 128), transpose=True, both=True)
    q, s = quant.quantize_rows(torch.randn(0, 256))
    assert q.shape == (0, 256) and s.shape == (0, 2)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("h", [256, 200, 40])
def test_swiglu_quantize_keeps_h_quantized_as_quantize_rows(poison_alloc, interleaved, h):
    """keep_preact: A's pair as without it, and H's equal to quantize_rows(H) bit for bit; hard rows (zero,
    outliers, tiny) in H; h = 200 gate-first takes the fallback pass, 40 interleaved a second group past H's end."""
    gen = torch.Generator().manual_seed(h + 7 * interleaved)
    preact = _hard_rows(37, 2 * h, torch.float16, gen)
    got_a, got_h = quant.swiglu_quantize(preact, interleaved, keep_preact=True)
    _same(got_a, quant.swiglu_quantize(preact, interleaved))
    _same(got_h, quantize_rows(preact))
