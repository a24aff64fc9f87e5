"""precision="fp8" composed with what it used to refuse: expert biases (gpt-oss's layout: biases, interleaved gate/up
columns, transposed weight views, the clamped SwiGLU) and chunk_tokens, on the kernels (interpreter, fp32) against
the reference's emulation of the same recipe: the output and every gradient, outputs poisoned."""
import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze.experts import moe_experts
from moeblaze.routing import build_routing_index

from helpers import FP8_VS_EMULATION, random_problem, rel_err

NAMES = ("out", "dx", "dw1", "dw2", "dw", "db1", "db2")


def _run(x, idx, w, w1, w2, b1, b2, dy, config, interleaved=False, transposed=False):
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w, b1, b2)]
    x_, w1_, w2_, w_, b1_, b2_ = leaves
    if transposed:  # gpt-oss stores (E, D, F) and (E, H, D): the op reads the transposed views in place
        w1_, w2_ = w1_.transpose(1, 2), w2_.transpose(1, 2)
    out = moe_experts(x_, build_routing_index(idx, w1.shape[0]), w_, w1_, w2_, b1_, b2_, experts=config,
                      interleaved=interleaved)
    return [out, *torch.autograd.grad(out, leaves, dy)]


@pytest.mark.parametrize("activation,interleaved,transposed,checkpoint,chunk", [
    ("swiglu", False, False, "preact", None),
    ("clamped_swiglu", True, True, "preact", None),  # gpt-oss
    ("clamped_swiglu", True, True, "recompute", 16),
    ("swiglu", False, False, "preact-fp8", 20),
    ("gelu", False, False, "recompute", None),
])
def test_fp8_with_biases_and_chunks_matches_the_emulation(poison_alloc, activation, interleaved, transposed,
                                                          checkpoint, chunk):
    """Within 1e-3 of the emulation (the bound of test_precision_fp8_kernels_match_the_emulation: an element on an
    e4m3 rounding boundary may round the other way), and within the recipe's own error of native precision."""
    torch.manual_seed(1)
    E = 5
    x, w1, w2, idx, w = random_problem(48, 160, 96 if activation == "gelu" else 72, E, 2, activation)
    if transposed:
        w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    b1 = torch.randn(E, w1.shape[2] if transposed else w1.shape[1]) * 0.1
    b2 = torch.randn(E, 160) * 0.1
    dy = torch.randn_like(x)
    fp8 = ExpertsConfig(activation=activation, checkpoint=checkpoint, precision="fp8", fp8_min_rows=0,
                        chunk_tokens=chunk)
    args = (x, idx, w, w1, w2, b1, b2, dy)
    got = _run(*args, fp8.replace(backend="triton"), interleaved, transposed)
    emulated = _run(*args, fp8.replace(backend="reference"), interleaved, transposed)
    exact = _run(*args, ExpertsConfig(activation=activation, backend="reference"), interleaved, transposed)
    for name, g, e, r in zip(NAMES, got, emulated, exact):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, e) <= FP8_VS_EMULATION, (name, rel_err(g, e))
        assert rel_err(g, r) < 0.1, (name, rel_err(g, r))
    assert rel_err(got[1], exact[1]) > 1e-4  # the gradients do go through e4m3


def test_fp8_chunks_equal_one_chunk():
    """Chunked fp8 against one chunk: each chunk quantizes the same rows and weights, but the kernels' fp32 sums may
    run in another order at another row count, so an element on an e4m3 rounding boundary may round the other way:
    1e-3, the bound against the emulation above."""
    torch.manual_seed(2)
    x, w1, w2, idx, w = random_problem(40, 128, 64, 4, 2)
    dy = torch.randn_like(x)
    cfg = ExpertsConfig(precision="fp8", fp8_min_rows=0, backend="triton")

    def run(config):
        ins = [t.clone().requires_grad_() for t in (x, w1, w2, w)]
        out = moe_experts(ins[0], build_routing_index(idx, 4), ins[3], ins[1], ins[2], experts=config)
        return [out, *torch.autograd.grad(out, ins, dy)]

    whole, chunked = run(cfg), run(cfg.replace(chunk_tokens=16))
    for name, a, b in zip(("out", "dx", "dw1", "dw2", "dw"), whole, chunked):
        assert rel_err(a, b) <= FP8_VS_EMULATION, (name, rel_err(a, b))


def test_fp8_nan_and_inf_reach_the_output_as_in_native_precision():
    """A NaN or Inf in x reaches its token's output under precision="fp8" as under native precision and in the
    emulation (the quantizers' max dropped NaN: a NaN token came out finite), and in dy its token's dx."""
    torch.manual_seed(2)
    x, w1, w2, idx, w = random_problem(24, 128, 64, 4, 2)
    x[3, 5], x[9, 0] = float("nan"), float("inf")
    routing = build_routing_index(idx, 4)

    def bad_rows(config):
        xi = x.clone().requires_grad_()
        out = moe_experts(xi, routing, w, w1, w2, experts=config)
        dy = torch.randn_like(out)
        dy[15, 2] = float("nan")
        out.backward(dy)
        return [(~torch.isfinite(t)).any(1).nonzero().flatten().tolist() for t in (out, xi.grad)]

    native = bad_rows(ExpertsConfig(backend="triton"))
    assert native[0] == [3, 9]
    for recipe in ("preact", "preact-fp8", "recompute"):
        for backend in ("triton", "reference"):
            fp8 = ExpertsConfig(backend=backend, precision="fp8", fp8_min_rows=0, checkpoint=recipe)
            assert bad_rows(fp8) == native, (recipe, backend)
