"""Property-based tests of the routing index: every builder against the others and the index's invariants, over
random token counts (0 included), expert counts on both sides of DENSE_MAX_EXPERTS, top-k and skewed routings.
Derandomized with a fixed example budget, so a run is fast and repeatable."""
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moeblaze.routing import build_routing_index
from moeblaze.routing.index import (DENSE_MAX_EXPERTS, build_index_dense_torch, build_index_dense_triton,
                                    build_index_sort)
from helpers import check_invariants


@st.composite
def routings(draw):
    """(L, K) distinct expert ids per token, int32 or int64, and E: scores with a drawn skew, top-K per token."""
    E = draw(st.one_of(st.integers(1, 16), st.sampled_from([DENSE_MAX_EXPERTS, DENSE_MAX_EXPERTS + 1, 256])))
    K = draw(st.integers(1, min(E, 8)))
    L = draw(st.integers(0, 80))
    skew = draw(st.sampled_from(["uniform", "hot", "zipf"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scores = torch.rand(L, E, generator=gen)
    if skew == "hot":  # the same few experts win for every token; the rest get nothing
        scores[:, : max(K, E // 8)] += 2.0
    elif skew == "zipf":  # expert e favoured in proportion to 1 / (e + 1)
        scores = scores / torch.arange(1, E + 1)
    idx = scores.topk(K, dim=1).indices
    return idx.to(draw(st.sampled_from([torch.int32, torch.int64]))), E


@settings(max_examples=40, derandomize=True, deadline=None)
@given(routings())
@example((torch.zeros(0, 2, dtype=torch.int32), 4))  # an empty batch
@example((torch.zeros(0, 3, dtype=torch.int64), DENSE_MAX_EXPERTS + 1))  # an empty batch past the dense builder
@example((torch.randperm(200)[:8].repeat(33, 1), 200))  # every token to the same 8 of 200 experts
def test_builders_agree_and_keep_the_invariants(routing):
    idx, E = routing
    built = [build_index_sort(idx, E), build_index_dense_torch(idx, E), build_index_dense_triton(idx, E),
             build_routing_index(idx, E)]
    for r in built:
        check_invariants(r, idx)
    for r in built[1:]:  # identical, not just equivalent: tokens ascend inside each expert in every builder
        assert all(torch.equal(a, b) for a, b in zip(built[0].tensors(), r.tensors()))
