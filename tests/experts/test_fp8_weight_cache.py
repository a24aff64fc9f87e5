"""precision="fp8" with fp8_weight_cache (experts.fp8.weight_pair, interpreter): the same arithmetic as quantizing
where used, each weight quantized once per change (both layouts from one read), re-quantized after an in-place
update (an optimizer step), never a stale copy, nothing kept for a weight that is gone."""
import gc

import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze import MoELayer
from moeblaze.experts import fp8, moe_experts
from moeblaze.experts import quant
from moeblaze.routing import build_routing_index

from helpers import random_problem


@pytest.fixture
def quantize_calls(monkeypatch):
    """The weight quantizer's calls, as (shape, both) pairs."""
    calls = []
    real = quant.quantize_blocks

    def counting(w, transpose=False, both=False):
        calls.append((tuple(w.shape), both))
        return real(w, transpose, both)
    monkeypatch.setattr(quant, "quantize_blocks", counting)
    return calls


def _step(x, routing, w, w1, w2, dy, cache, interleaved=False):
    ins = [t.detach().clone().requires_grad_() for t in (x, w)]
    config = ExpertsConfig(precision="fp8", fp8_min_rows=0, fp8_weight_cache=cache, backend="triton")
    out = moe_experts(ins[0], routing, ins[1], w1, w2, experts=config, interleaved=interleaved)
    return [out, *torch.autograd.grad(out, [*ins, w1, w2], dy)]


def test_cached_weights_give_the_same_step_and_are_quantized_once_per_change(poison_alloc, quantize_calls):
    torch.manual_seed(0)
    x, w1, w2, idx, w = random_problem(40, 128, 72, 4, 2)
    routing = build_routing_index(idx, 4)
    dy = torch.randn_like(x)
    w1.requires_grad_()
    w2.requires_grad_()
    plain = _step(x, routing, w, w1, w2, dy, cache=False)
    assert len(quantize_calls) == 4 and not any(both for _, both in quantize_calls)  # W1, W2, W2ᵀ, W1ᵀ
    quantize_calls.clear()
    for _ in range(2):  # two micro-batches of one optimizer step: one quantization of each weight, both layouts
        got = _step(x, routing, w, w1, w2, dy, cache=True)
        for a, b in zip(got, plain):
            assert torch.equal(a, b)
        assert quantize_calls == [(tuple(w1.shape), True), (tuple(w2.shape), True)]
    quantize_calls.clear()
    opt = torch.optim.SGD([w1, w2], lr=0.1)
    w1.grad, w2.grad = plain[3], plain[4]
    opt.step()  # in place: the version counters move, so the cached copies are stale
    got = _step(x, routing, w, w1, w2, dy, cache=True)
    assert len(quantize_calls) == 2
    for a, b in zip(got, _step(x, routing, w, w1, w2, dy, cache=False)):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], plain[0])  # the update did change the step


def test_a_transposed_weight_view_is_cached_in_its_own_layout(poison_alloc):
    """A weight given as a transposed view (gpt-oss keeps W1 as (E, D, F)): the pair quantized from its storage is
    the pair of the view, each K-major."""
    torch.manual_seed(1)
    storage = torch.randn(3, 256, 384)  # (E, K, N): the view (E, N, K) is storage.transpose(1, 2)
    view = storage.transpose(1, 2)
    (q, s), (qt, st) = fp8.weight_pair(view)
    for (a, b), (c, d) in (((q, s), fp8.quantize_weight(view)), ((qt, st), fp8.quantize_weight(storage))):
        assert a.is_contiguous() and torch.equal(a.float(), c.float()) and torch.equal(b, d)


def test_the_cache_forgets_a_weight_that_is_gone(poison_alloc):
    w = torch.randn(2, 256, 128)
    fp8.weight_pair(w)
    key = id(w)
    assert key in fp8._PAIRS
    del w
    gc.collect()
    assert key not in fp8._PAIRS


def test_an_inference_tensor_is_quantized_where_used(poison_alloc, quantize_calls):
    """Under torch.inference_mode a weight made there has no version counter: it is never cached."""
    with torch.inference_mode():
        x, w1, w2, idx, w = random_problem(16, 128, 64, 2, 1)
        routing = build_routing_index(idx, 2)
        for _ in range(2):
            moe_experts(x, routing, w, w1, w2, experts=ExpertsConfig(precision="fp8", fp8_min_rows=0,
                                                                    fp8_weight_cache=True, backend="triton"))
    assert quantize_calls == [(tuple(w1.shape), False), (tuple(w2.shape), False)] * 2


def test_fp8_weight_cache_needs_fp8():
    x, w1, w2, idx, w = random_problem(8, 128, 64, 2, 1)
    with pytest.raises(ValueError, match="fp8_weight_cache"):
        moe_experts(x, build_routing_index(idx, 2), w, w1, w2, experts=ExpertsConfig(fp8_weight_cache=True,
                                                                                    backend="triton"))
    with pytest.raises(ValueError, match="fp8_weight_cache"):
        MoELayer(128, 64, 2, 1, experts=ExpertsConfig(fp8_weight_cache=True))
    layer = MoELayer(128, 64, 2, 1, experts=ExpertsConfig(precision="fp8", fp8_min_rows=0, fp8_weight_cache=True))
    assert "fp8_weight_cache" in repr(layer.experts)


def _parameters(seed):
    """(x, routing, w, w1, w2, dy): a problem whose expert weights are Parameters."""
    torch.manual_seed(seed)
    x, w1, w2, idx, w = random_problem(40, 128, 72, 4, 2)
    return x, build_routing_index(idx, 4), w, torch.nn.Parameter(w1), torch.nn.Parameter(w2), torch.randn_like(x)


def test_a_write_through_data_is_unseen_until_the_cache_is_cleared(poison_alloc):
    """`param.data.copy_(...)` (some loaders, EMA code) moves no version counter, so the cache can't see it: the
    documented limit. clear_weight_cache(param) (or with no argument, every weight) makes the next step quantize
    the new values: equal to quantizing where used."""
    from moeblaze.experts import clear_weight_cache

    x, routing, w, w1, w2, dy = _parameters(4)
    before = _step(x, routing, w, w1, w2, dy, cache=True)
    w1.data.copy_(torch.randn_like(w1) / 10)
    stale = _step(x, routing, w, w1, w2, dy, cache=True)
    assert torch.equal(stale[0], before[0])  # the documented limit: the cached copy of the old values
    for weight in (w1, None):
        clear_weight_cache(weight)
        fresh = _step(x, routing, w, w1, w2, dy, cache=True)
        for a, b in zip(fresh, _step(x, routing, w, w1, w2, dy, cache=False)):
            assert torch.equal(a, b)
        assert not torch.equal(fresh[0], before[0])
        w1.data.mul_(0.5)  # again unseen, for the second round's clear-all


def _sgd(params, grads):
    opt = torch.optim.SGD(params, lr=0.1)
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()


def _adamw(**kw):
    def step(params, grads):
        opt = torch.optim.AdamW(params, lr=0.1, **kw)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return step


def _no_grad_copy(params, grads):
    with torch.no_grad():
        params[0].copy_(params[0] - 0.1 * grads[0])


def _load_state_dict(params, grads):
    holder = torch.nn.ParameterList(params)
    holder.load_state_dict({"0": params[0].detach() - 0.1 * grads[0], "1": params[1].detach()})


@pytest.mark.parametrize("update", [_sgd, _adamw(foreach=False), _adamw(foreach=True), _adamw(fused=True),
                                    _no_grad_copy, _load_state_dict],
                         ids=["sgd", "adamw", "adamw-foreach", "adamw-fused", "no_grad-copy_", "load_state_dict"])
def test_every_update_of_a_parameter_is_seen(poison_alloc, quantize_calls, update):
    """The ways a trained weight changes in place (the optimizers' loops, their foreach and fused kernels, a
    no_grad copy_, load_state_dict) each move its version counter: the next step quantizes the new values, equal
    bit for bit to quantizing where used, and the update did change the step."""
    x, routing, w, w1, w2, dy = _parameters(5)
    before = _step(x, routing, w, w1, w2, dy, cache=True)
    quantize_calls.clear()
    update([w1, w2], [before[3], before[4]])
    after = _step(x, routing, w, w1, w2, dy, cache=True)
    assert (tuple(w1.shape), True) in quantize_calls  # W1 quantized again (both layouts)
    for a, b in zip(after, _step(x, routing, w, w1, w2, dy, cache=False)):
        assert torch.equal(a, b)
    assert not torch.equal(after[0], before[0])
