"""Shared experts against a dense fp64 computation written out by hand: out = Σ_s g(x) · W2_s act(W1_s x) with
g = σ(x·gᵀ) (gated) or 1, on the Triton kernels (interpreter) and the reference, under both checkpoint policies:
the layer's output and every gradient (x, gate, shared and routed weights, router), with poisoned allocations."""
import pytest
import torch

from moeblaze import ExpertsConfig, RoundingConfig, SharedConfig
from moeblaze import MoELayer
from moeblaze.reference import apply_activation

from helpers import ROUTING_WEIGHTS_RTOL, assert_within_torch_error, rel_err


def _dense_shared(x, shared):
    """fp64, by hand."""
    w1, w2 = shared.w1.double(), shared.w2.double()
    g = torch.sigmoid(x @ shared.gate.double().t()) if shared.gate is not None else torch.ones(x.shape[0], 1,
                                                                                             dtype=x.dtype)
    return sum(g * (apply_activation(x @ w1[s].t(), shared.config.activation) @ w2[s].t()) for s in range(w1.shape[0]))


@pytest.mark.parametrize("impl,checkpoint,gated,count", [
    ("triton", "preact", True, 2), ("triton", "recompute", False, 1), ("reference", "preact", True, 1)])
def test_shared_experts_match_a_dense_computation(poison_alloc, impl, checkpoint, gated, count):
    shared = SharedConfig(count, d_hidden=24, gated=gated)
    layer = MoELayer(16, 32, 4, 2, experts=ExpertsConfig(checkpoint=checkpoint, backend=impl), shared=shared)
    with torch.no_grad():
        if gated:
            layer.shared.gate.normal_()
    refs = [MoELayer(16, 32, 4, 2, experts=ExpertsConfig(backend="reference"), shared=shared).to(dtype)
            for dtype in (torch.float32, torch.float64)]  # torch at the layer's precision, and the exact result
    for ref in refs:
        ref.load_state_dict({k: v.to(ref.shared.w1.dtype) for k, v in layer.state_dict().items()})
    x = torch.randn(2, 5, 16)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_(), x.double().requires_grad_()]
    got, same, want = layer(xs[0]), refs[0](xs[1]), refs[1](xs[2])
    r = refs[1].router(xs[2].reshape(-1, 16))
    routed = refs[1].experts(xs[2].reshape(-1, 16), r.topk_idx, r.topk_weights)
    hand = routed + _dense_shared(xs[2].reshape(-1, 16), refs[1].shared)
    # the fp64 layer is the hand computation: the same fp64 sums in another order, a few ulps (2^-52) apart
    assert rel_err(want.out.reshape(-1, 16), hand) < 1e-12
    assert_within_torch_error(got.out, same.out, want.out)
    dy = torch.randn(x.shape)
    for y, t in zip((got, same, want), (torch.float32, torch.float32, torch.float64)):
        y.out.backward(dy.to(t))
    assert_within_torch_error(xs[0].grad, xs[1].grad, xs[2].grad)
    params = [dict(m.named_parameters()) for m in refs]
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
        assert_within_torch_error(p.grad, params[0][name].grad, params[1][name].grad)


def test_shared_experts_stay_out_of_routing():
    layer = MoELayer(16, 32, 4, 2, shared=SharedConfig())
    assert layer.router.num_experts == 4 and layer.shared.num_experts == 1
    with pytest.raises(ValueError, match="count must be >= 1"):
        MoELayer(16, 32, 4, 2, shared=SharedConfig(count=0))


@pytest.mark.filterwarnings("ignore:token rounding with")
def test_token_rounding_layer_trains_rounded_and_evaluates_plain():
    """MoELayer(rounding=RoundingConfig("up")): in training the experts compute the rounded routing (the manual
    composition of round_to_index and moe_experts, whose index is the reference rounding's, its weights the
    reference's to fp32 rounding: the kernels compute them in their own order); in evaluation, plain top-k (the
    same layer without it)."""
    from moeblaze.experts import moe_experts
    from moeblaze.routing import round_to_index
    from moeblaze.routing.rounding import round_tokens, rounded_index

    layer = MoELayer(16, 32, 4, 2, experts=ExpertsConfig(backend="triton"), rounding=RoundingConfig("up", tile=16),
                     shared=SharedConfig())
    plain = MoELayer(16, 32, 4, 2, experts=ExpertsConfig(backend="triton"), shared=SharedConfig())
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(3, 30, 16)
    got = layer(x).out
    r = layer.router(x.reshape(-1, 16), seq_len=30)
    index, w, over = round_to_index(r.logits, r.topk_idx, r.topk_weights, 16, "up", max_experts=4,
                                    max_rows=90 * 2 + 4 * 15)  # min(E, 4K) = 4
    want = moe_experts(x.reshape(-1, 16), index, w, layer.w1, layer.w2,
                       experts=ExpertsConfig(backend="triton")) + layer.shared(x.reshape(-1, 16))
    assert not over and torch.equal(got.reshape(-1, 16), want)
    rr = round_tokens(r.logits, r.topk_idx, r.topk_weights, 16, "up")
    index_ref, w_ref, _ = rounded_index(rr.kept_LE, rr.weights_LE, 4, 90 * 2 + 4 * 15)
    assert torch.equal(index.token_slot, index_ref.token_slot)
    assert torch.equal(index.expert_token_idx, index_ref.expert_token_idx)
    torch.testing.assert_close(w, w_ref, rtol=ROUTING_WEIGHTS_RTOL, atol=0)
    assert not torch.equal(got, plain(x).out)  # rounding changed the routing
    layer.eval()
    plain.eval()
    assert torch.equal(layer(x).out, plain(x).out)
    with pytest.raises(ValueError, match="rule must be one of"):
        RoundingConfig("sr-f")
