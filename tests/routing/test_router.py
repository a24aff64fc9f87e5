import math

import pytest
import torch

from moeblaze import RouterConfig
from moeblaze.routing import TopKRouter, route_topk
from moeblaze.routing.router import router_z_loss, switch_aux_loss

from helpers import assert_within_torch_error


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
                                          (dict(top_k=2, config=RouterConfig(num_groups=3)), "num_groups")])
def test_router_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TopKRouter(16, 8, **kwargs)


def test_losses_of_an_empty_batch_are_zero_and_back_propagate():
    router = TopKRouter(16, 8, 2)
    r = router(torch.randn(0, 16))
    assert r.topk_idx.shape == (0, 2) and r.aux_loss.item() == 0 and r.z_loss.item() == 0
    (r.aux_loss + r.z_loss).backward()
    assert torch.equal(router.weight.grad, torch.zeros_like(router.weight))


def _rounding_misses(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Fraction of got's bf16 values that are not exact's (fp64) rounded to bf16."""
    return (got != exact.to(torch.bfloat16)).float().mean().item()


def test_bf16_logits_are_the_fp32_product_and_their_gradients_nearly_exact():
    """bf16 x and weight: logits equal to the fp32 product's (bf16 products are exact in fp32), and both
    gradients rounded from an fp32 result within 2^-16 of exact, so they are the exact gradient's bf16 rounding
    almost everywhere; a gradient taken through a plain bf16 cast of the logits' gradient misses far more."""
    from moeblaze.routing.router import router_logits

    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 256, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(64, 256, generator=g) * 0.1).bfloat16().requires_grad_()
    dy = torch.randn(512, 64, generator=g)
    logits = router_logits(x, w)
    assert logits.dtype == torch.float32
    want = x.detach().double() @ w.detach().double().t()
    assert_within_torch_error(logits, x.detach().float() @ w.detach().float().t(), want)
    dx, dw = torch.autograd.grad(logits, (x, w), dy)
    assert dx.dtype == dw.dtype == torch.bfloat16
    dx_exact, dw_exact = dy.double() @ w.detach().double(), dy.double().t() @ x.detach().double()
    # within 2^-16 of exact, a bf16 rounding (steps of 2^-8) goes the other way only where exact lies that close
    # to a midpoint: odds about 2 · 2^-16 / 2^-8 (0.8%) per value; a plain bf16 cast misses far more (below)
    assert _rounding_misses(dx, dx_exact) < 0.02 and _rounding_misses(dw, dw_exact) < 0.02
    dy16 = dy.bfloat16().float()  # what a gradient through a bf16 cast of dy would see
    plain = (dy16 @ w.detach().float()).bfloat16(), (dy16.t() @ x.detach().float()).bfloat16()
    assert _rounding_misses(plain[0], dx_exact) > 0.1 and _rounding_misses(plain[1], dw_exact) > 0.1


def test_router_logits_in_fp32_where_either_operand_is_not_bf16():
    from moeblaze.routing.router import router_logits

    x, w = torch.randn(8, 16), torch.randn(4, 16)
    assert torch.equal(router_logits(x, w), x @ w.t())
    assert torch.equal(router_logits(x.bfloat16(), w), x.bfloat16().float() @ w.t())


def _tensor_core_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A model of a bf16 tensor-core GEMM with fp32 output: each 16-deep step's products summed exactly, then added
    to the fp32 accumulator with truncation (rounded toward zero)."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for k in range(0, a.shape[1], 16):
        v = acc.double() + a[:, k:k + 16].double() @ b[k:k + 16].double()
        f = v.float()
        acc = torch.where(f.double().abs() > v.abs(), torch.nextafter(f, torch.zeros_like(f)), f)
    return acc


def test_bf16_logits_under_truncating_tensor_core_sums(monkeypatch):
    """The GPU test's bounds hold on a model of Hopper's accumulation: logits within (D / 16) · 2^-23 · sum |x w|
    of exact (and well past the fp32 GEMM's own error, so the model is not trivially exact), gradients the exact
    ones' bf16 rounding at all but < 2% of places."""
    from moeblaze.routing import router

    monkeypatch.setattr(router, "_mm_fp32", _tensor_core_mm)
    g = torch.Generator().manual_seed(3)
    L, D, E = 2048, 2048, 128
    x = torch.randn(L, D, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(E, D, generator=g) * D ** -0.5).bfloat16().requires_grad_()
    dy = torch.randn(L, E, generator=g)
    logits = router.router_logits(x, w)
    xd, wd = x.detach().double(), w.detach().double()
    err = (logits.double() - xd @ wd.t()).abs()
    assert (err <= (D / 16) * 2.0 ** -23 * (xd.abs() @ wd.abs().t())).all()
    assert err.max() > 3 * (x.detach().float() @ w.detach().float().t() - xd @ wd.t()).abs().max()
    dx, dw = torch.autograd.grad(logits, (x, w), dy)
    # the same odds as above (0.8% at 2^-16 of exact): the model's truncation sits on the fp32 result, not here
    assert _rounding_misses(dx, dy.double() @ wd) < 0.02 and _rounding_misses(dw, dy.double().t() @ xd) < 0.02
