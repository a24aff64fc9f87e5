"""precision="fp8" on float32 master weights of a half-precision x (experts.autocast_weights): an e4m3 call
quantizes the masters where they lie, as the reference's emulation does from the same values, and returns their
gradients in float32; a call that runs native GEMMs (fp8_min_rows) casts them, bit for bit as a cast by the caller;
precision="native" refuses them; under autocast an Experts module keeps no half-precision copy of its weights to
backward. Kernels under the interpreter (float16 x)."""
import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze.experts import moe_experts
from moeblaze.nn import Experts
from moeblaze.routing import build_routing_index

from helpers import random_problem, rel_err

E = 4


def _problem(seed=5):
    torch.manual_seed(seed)
    x, w1, w2, idx, w = random_problem(40, 128, 64, E, 2)
    return x.half(), w1, w2, idx, w, torch.randn(40, 128).half()


def _run(x, w1, w2, idx, w, dy, config, parts=False, cast=False):
    """Output and the gradients of x, w1, w2, w; cast: the caller casts the weights to x's dtype (differentiably)."""
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w)]
    w1_, w2_ = (t.to(x.dtype) for t in leaves[1:3]) if cast else leaves[1:3]
    if parts:  # W1's gate and up rows apart, as torchtitan stores them
        w1_ = tuple(w1_.chunk(2, dim=1))
    out = moe_experts(leaves[0], build_routing_index(idx, E), leaves[3], w1_, w2_, experts=config)
    return [out, *torch.autograd.grad(out, leaves, dy)]


@pytest.mark.parametrize("checkpoint,parts", [("preact", False), ("recompute", False), ("preact", True)])
def test_e4m3_calls_quantize_the_masters_as_the_emulation_does(poison_alloc, checkpoint, parts):
    """(preact-fp8 is left out: its e4m3 copy of a float16 H flips elements on e4m3 rounding boundaries between any
    two orders of float16 arithmetic, the kernels' and the emulation's, with or without masters.)"""
    x, w1, w2, idx, w, dy = _problem()
    config = ExpertsConfig(checkpoint=checkpoint, precision="fp8", fp8_min_rows=0)
    got = _run(x, w1, w2, idx, w, dy, config.replace(backend="triton"), parts)
    emulated = _run(x, w1, w2, idx, w, dy, config.replace(backend="reference"), parts)
    # the recipe's arithmetic from the same masters with x and dy in float32: what float16's roundings move away from
    exact = _run(x.float(), w1, w2, idx, w, dy.float(), config.replace(backend="reference"), parts)
    assert [t.dtype for t in got] == [torch.float16, torch.float16, torch.float32, torch.float32, torch.float32]
    eps = torch.finfo(torch.float16).eps
    for name, g, e, r in zip(("out", "dx", "dw1", "dw2", "dw"), got, emulated, exact):
        assert torch.isfinite(g).all(), name
        # within twice the emulation's own float16 error plus two float16 epsilons (the suite's rule)
        assert rel_err(g, r) <= 2 * rel_err(e, r) + 2 * eps, (name, rel_err(g, r), rel_err(e, r))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_native_calls_cast_the_masters_bitwise_as_the_caller_would(backend):
    x, w1, w2, idx, w, dy = _problem(6)
    config = ExpertsConfig(precision="fp8", fp8_min_rows=10 ** 6, backend=backend)  # fewer rows: native GEMMs
    masters = _run(x, w1, w2, idx, w, dy, config)
    cast = _run(x, w1, w2, idx, w, dy, config, cast=True)
    for name, a, b in zip(("out", "dx", "dw1", "dw2", "dw"), masters, cast):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_precision_native_refuses_masters():
    x, w1, w2, idx, w, _ = _problem()
    with pytest.raises(TypeError, match="master weights"):
        moe_experts(x, build_routing_index(idx, E), w, w1, w2, experts=ExpertsConfig(backend="triton"))


def _saved_under_autocast(config):
    """(the layer's output, the dtypes and shapes of every tensor its forward saves for backward) under CPU autocast
    to float16, and the layer."""
    torch.manual_seed(7)
    layer = Experts(128, 64, E, experts=config)
    x, _, _, idx, w = random_problem(40, 128, 64, E, 2)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t
    with torch.autocast("cpu", dtype=torch.float16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, idx, w)
    return out, saved, layer, (x, idx, w)


def test_experts_under_autocast_keep_no_half_copy_of_their_weights():
    fp8 = ExpertsConfig(precision="fp8", fp8_min_rows=0, backend="triton")
    out, saved, layer, (x, idx, w) = _saved_under_autocast(fp8)
    shapes = {tuple(layer.w1.shape), tuple(layer.w2.shape)}
    assert not [s for s in saved if s[1] in shapes and s[0] == torch.float16]
    assert [s for s in saved if s[1] in shapes and s[0] == torch.float32]  # the masters themselves
    want = moe_experts(x.half(), build_routing_index(idx, E), w, layer.w1, layer.w2, experts=fp8)
    assert torch.equal(out, want)
    out.float().sum().backward()
    assert layer.w1.grad.dtype == layer.w2.grad.dtype == torch.float32
    # native precision casts them, like nn.Linear: a half copy of each weight is what its backward reads
    _, saved, _, _ = _saved_under_autocast(ExpertsConfig(backend="triton"))
    assert {s[1] for s in saved if s[0] == torch.float16} >= shapes


@pytest.mark.parametrize("cache", [False, True])
def test_the_weight_cache_keys_on_the_parameters_under_autocast(monkeypatch, cache):
    """Under autocast the cache sees the parameters themselves (a cast copy is a new tensor every call, which no
    cached pair of an earlier micro-batch could match): with fp8_weight_cache each weight is quantized once per
    optimizer step, both layouts in one call, for every micro-batch's forward and backward; without it in each
    forward and each backward; an optimizer step forgets the pairs."""
    from moeblaze.experts import clear_weight_cache, quant

    clear_weight_cache()
    calls, real = [], quant.quantize_blocks
    monkeypatch.setattr(quant, "quantize_blocks", lambda w, *a, **k: calls.append(k.get("both", False)) or
                        real(w, *a, **k))
    torch.manual_seed(8)
    layer = Experts(128, 64, E, experts=ExpertsConfig(precision="fp8", fp8_min_rows=0, backend="triton",
                                                     fp8_weight_cache=cache))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x, _, _, idx, w = random_problem(40, 128, 64, E, 2)
    for step in range(2):
        for _micro_batch in range(2):  # gradient accumulation: two forward and backward passes per step
            with torch.autocast("cpu", dtype=torch.float16):
                out = layer(x, idx, w)
            out.float().sum().backward()
        opt.step()
        opt.zero_grad()
        # per step: w1 and w2 in both layouts by one call each with the cache, else two calls each per micro-batch
        assert calls == ([True, True] if cache else [False] * 8) * (step + 1), calls
    clear_weight_cache()
