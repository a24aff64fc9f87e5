import math

import pytest
import torch

from moeblaze.routing import TopKRouter, route_topk, router_z_loss, switch_aux_loss


def test_softmax_topk_renormalized():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    idx, w = route_topk(logits, 2, "softmax_topk", renormalize=True)
    assert idx.dtype == torch.int32 and w.dtype == torch.float32
    assert idx.tolist() == [[2, 1]]
    e = [math.exp(v) for v in (3.0, 2.0)]
    assert torch.allclose(w, torch.tensor([[e[0] / sum(e), e[1] / sum(e)]]))


def test_softmax_topk_not_renormalized_keeps_full_softmax_probs():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    _, w = route_topk(logits, 2, "softmax_topk", renormalize=False)
    z = sum(math.exp(v) for v in (1.0, 2.0, 3.0, 0.0))
    assert torch.allclose(w, torch.tensor([[math.exp(3.0) / z, math.exp(2.0) / z]]))


def test_topk_softmax_softmax_over_selected_logits():
    logits = torch.tensor([[0.5, -1.0, 2.0]])
    idx, w = route_topk(logits, 2, "topk_softmax")
    assert idx.tolist() == [[2, 0]]
    d = math.exp(2.0) + math.exp(0.5)
    assert torch.allclose(w, torch.tensor([[math.exp(2.0) / d, math.exp(0.5) / d]]))


def test_switch_aux_loss_hand_computed():
    # 2 tokens, 2 experts, top-1. probs: t0 = softmax(0, ln 3) = (1/4, 3/4); t1 = (1/2, 1/2).
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    idx = torch.tensor([[1], [0]], dtype=torch.int32)
    # f = (1/2, 1/2), P = (3/8, 5/8): loss = 2 * (1/2 * 3/8 + 1/2 * 5/8) = 1
    assert torch.allclose(switch_aux_loss(logits, idx), torch.tensor(1.0))
    idx = torch.tensor([[1], [1]], dtype=torch.int32)  # f = (0, 1): loss = 2 * 5/8
    assert torch.allclose(switch_aux_loss(logits, idx), torch.tensor(1.25))


def test_router_z_loss_hand_computed():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert torch.allclose(router_z_loss(logits), torch.tensor(expected, dtype=torch.float32))


def test_router_module_outputs_and_gradients():
    r = TopKRouter(16, 8, 2)
    x = torch.randn(10, 16, requires_grad=True)
    out = r(x)
    assert out.topk_idx.shape == (10, 2) and out.topk_idx.dtype == torch.int32
    assert torch.allclose(out.topk_weights.sum(-1), torch.ones(10))
    (out.topk_weights.square().sum() + out.aux_loss + out.z_loss).backward()
    assert r.weight.grad is not None and torch.isfinite(r.weight.grad).all() and r.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kwargs,match", [(dict(top_k=9), "top_k"), (dict(top_k=0), "top_k"),
                                          (dict(top_k=2, scoring="sigmoid"), "scoring")])
def test_router_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TopKRouter(16, 8, **kwargs)


def test_losses_of_an_empty_batch_are_zero_and_back_propagate():
    router = TopKRouter(16, 8, 2)
    r = router(torch.randn(0, 16))
    assert r.topk_idx.shape == (0, 2) and r.aux_loss.item() == 0 and r.z_loss.item() == 0
    (r.aux_loss + r.z_loss).backward()
    assert torch.equal(router.weight.grad, torch.zeros_like(router.weight))
