import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze.reference import ACTIVATIONS, moe_experts_dense, moe_experts_reference
from helpers import random_problem, rel_err


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_matches_dense_per_token(activation):
    x, w1, w2, idx, w = random_problem(23, 12, 10, 5, 2, activation, torch.float64)
    # fp64 both ways, the same products summed in another order: a few ulps of 2^-52; a wrong sum errs by O(1)
    assert rel_err(moe_experts_reference(x, idx, w, w1, w2, experts=ExpertsConfig(activation=activation)),
                   moe_experts_dense(x, idx, w, w1, w2, experts=ExpertsConfig(activation=activation))) < 1e-12


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_gradcheck_fp64(activation):
    x, w1, w2, idx, w = random_problem(6, 5, 4, 3, 2, activation, torch.float64)
    w = w.double()
    args = [t.clone().requires_grad_() for t in (x, w1, w2, w)]
    fn = lambda x, w1, w2, w: moe_experts_reference(x, idx, w, w1, w2, experts=ExpertsConfig(activation=activation))  # noqa: E731
    # fp64 central differences at eps 1e-6 err by ~eps² + 2^-52 / eps (1e-10): torch's default atol 1e-5, 10x tighter
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6)


def test_reference_expert_with_no_tokens_gets_zero_grad():
    x, w1, w2, idx, w = random_problem(9, 6, 4, 6, 2, skew="empty")
    w1.requires_grad_()
    moe_experts_reference(x, idx, w, w1, w2).sum().backward()
    assert torch.count_nonzero(w1.grad[3:]) == 0 and torch.count_nonzero(w1.grad[:3]) > 0


def test_reference_keeps_input_dtype():
    x, w1, w2, idx, w = random_problem(7, 8, 4, 3, 2, dtype=torch.float16)
    assert moe_experts_reference(x, idx, w, w1, w2).dtype == torch.float16
