"""benchmarks/torchtitan_train.py's gradient average under --ep, on two CPU ranks: each replicated parameter's
gradient (the LM head's after its loss chunks, the rest as backward makes them) becomes the mean over the ranks,
bit for bit what torch computes from the ranks' gradients in the reduction's dtype (float32, or bfloat16 under
--reduce-dtype bfloat16, written back in float32)."""
import os
import sys

import pytest
import torch

pytest.importorskip("torchtitan")

from helpers import run_ranks  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def _model():
    """The same weights on every rank."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.body = torch.nn.Linear(16, 16)
    model.lm_head = torch.nn.Linear(16, 8, bias=False)
    return model


def _tokens(rank):
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(rank + 1))


def _grads(rank):
    """Rank `rank`'s own gradients."""
    model = _model()
    model.lm_head(model.body(_tokens(rank))).square().sum().backward()
    return [p.grad for p in model.parameters()]


def _average(rank, world, errors, dtype):
    import torchtitan_train

    model = _model()
    average = torchtitan_train.GradientAverage(model, getattr(torch, dtype))
    h = model.body(_tokens(rank))
    h_leaf = h.detach().requires_grad_()
    model.lm_head(h_leaf).square().sum().backward()  # the head's gradients first, as the chunked loss makes them
    average.head_done()
    h.backward(h_leaf.grad)
    average.finish()
    per_rank, t = [_grads(r) for r in range(world)], getattr(torch, dtype)
    for (name, p), gs in zip(model.named_parameters(), zip(*per_rank)):
        want = (sum(g.to(t) for g in gs) / world).float()
        if p.grad.dtype != torch.float32 or not torch.equal(p.grad, want):
            errors.put(f"{dtype} {name}: {(p.grad - want).abs().max()}")
        if dtype == "bfloat16" and torch.equal(p.grad, sum(gs) / world):
            errors.put(f"{name}: the bf16 average equals the fp32 one (nothing was rounded)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replicated_gradients_are_the_ranks_mean_in_the_reduction_dtype(dtype):
    run_ranks(_average, 2, dtype)
