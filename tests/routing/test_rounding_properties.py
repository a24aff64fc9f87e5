"""Property-based test of token rounding: round_to_index (the rounding kernels, under the interpreter) against
the sorting reference rounded_index(round_tokens(...)) over random batches (1 token included), expert counts,
top-k, tiles (larger than the batch too), rules, scorings, renormalization and bounds on experts per token, with
skewed and tied scores: the same index, no overflow at the default row bound, every token within its bound on
experts, the weights to fp32 rounding. Derandomized with a fixed example budget."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moeblaze.routing import round_to_index, route_topk
from moeblaze.routing.rounding import rounded_index, rounded_rows_bound, round_tokens

from helpers import ROUTING_WEIGHTS_RTOL


@st.composite
def roundings(draw):
    E = draw(st.integers(2, 24))
    K = draw(st.integers(1, min(E, 4)))
    L = draw(st.integers(1, 160))
    tile = draw(st.sampled_from([2, 4, 8, 16, 64, 256]))
    rule = draw(st.sampled_from(["nr-f", "up", "down"]))
    scoring = draw(st.sampled_from(["softmax_topk", "sigmoid_topk", "topk_softmax"]))
    renormalize = draw(st.booleans()) if scoring != "topk_softmax" else True
    max_experts = draw(st.integers(K, E))
    shape = draw(st.sampled_from(["normal", "hot", "ties"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(L, E, generator=gen) * 2
    if shape == "hot":  # a few tokens score high everywhere: the bound on experts per token binds
        logits[: max(1, L // 8)] += 6.0
    elif shape == "ties":  # exact ties everywhere: sigmoid of small integers
        logits = torch.randint(-2, 3, (L, E), generator=gen).float()
    return logits, K, tile, rule, scoring, renormalize, max_experts


@pytest.mark.filterwarnings("ignore:token rounding with")
@settings(max_examples=20, derandomize=True, deadline=None)
@given(roundings())
@example((torch.randn(1, 4), 2, 16, "nr-f", "softmax_topk", True, 2))  # one token, a tile larger than the batch
@example((torch.randn(1, 4), 2, 16, "up", "sigmoid_topk", True, 4))
def test_round_to_index_equals_the_sorting_reference(case):
    logits, K, tile, rule, scoring, renormalize, max_experts = case
    (L, E) = logits.shape
    idx, w = route_topk(logits, K, scoring, renormalize=renormalize, route_scale=1.5)
    rows = rounded_rows_bound(L, K, E, tile, rule)
    ref = round_tokens(logits, idx, w, tile, rule, scoring, renormalize, 1.5, max_experts=max_experts)
    want = rounded_index(ref.kept_LE, ref.weights_LE, max_experts, rows)
    got = round_to_index(logits, idx, w, tile, rule, scoring, renormalize, 1.5, max_experts=max_experts)
    for f in ("expert_counts", "expert_offsets", "expert_token_idx", "token_slot"):
        assert torch.equal(getattr(got[0], f), getattr(want[0], f)), f
    assert not bool(got[2]) and not bool(want[2])  # the default row bound holds, and max_experts by construction
    assert int(ref.kept_LE.sum(1).max()) <= max_experts
    assert int(got[0].expert_counts.sum()) == int(ref.kept_LE.sum()) <= rows
    torch.testing.assert_close(got[1], want[1], rtol=ROUTING_WEIGHTS_RTOL, atol=0)
