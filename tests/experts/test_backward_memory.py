"""Backward's peak: dX~'s rows are combined before dW1's buffer exists, and under checkpoint="preact" in eager mode
dH is written over the kept pre-activation where no later backward reads it (the graph not retained). Both change
where values are written, never the values: the gradients are bitwise those of the path that keeps preact."""
import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze.experts import moe_experts
from moeblaze.experts import op
from moeblaze.routing import build_routing_index

from helpers import random_problem


def _grads(retain: bool, activation="swiglu", calls=1, precision="native"):
    torch.manual_seed(0)
    fp8 = precision == "fp8"  # the recipe's 1 x 128 groups: widths of 128
    x, w1, w2, idx, w = random_problem(40, 128 if fp8 else 32, 128 if fp8 else 24, 6, 2, activation)
    ins = [t.clone().requires_grad_() for t in (x, w1, w2, w)]
    extra = dict(precision="fp8", fp8_min_rows=0) if fp8 else {}
    out = moe_experts(ins[0], build_routing_index(idx, 6), ins[3], ins[1], ins[2],
                      experts=ExpertsConfig(activation=activation, backend="triton", **extra))
    dy = torch.randn_like(out)
    return [torch.autograd.grad(out, ins, dy, retain_graph=retain or i < calls - 1) for i in range(calls)]


@pytest.mark.parametrize("activation,precision", [("swiglu", "native"), ("gelu", "native"), ("swiglu", "fp8")])
def test_dh_over_the_kept_preact_changes_no_gradient(poison_alloc, monkeypatch, activation, precision):
    seen = []
    real = op.experts_backward

    def spy(*args, **kw):
        seen.append(kw.get("overwrite_kept", False))
        return real(*args, **kw)

    monkeypatch.setattr(op, "experts_backward", spy)
    overwritten = _grads(False, activation, precision=precision)[0]
    kept = _grads(True, activation, precision=precision)[0]
    assert seen == [True, False]  # the graph not retained: dH over preact; retained: a buffer of its own
    assert all(torch.equal(a, b) for a, b in zip(overwritten, kept))


def test_a_retained_graph_backs_up_twice_to_the_same_gradients(poison_alloc):
    """retain_graph: the kept preact is not written over, so a second backward reads it intact."""
    first, second = _grads(True, calls=2)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
