import pytest
import torch

from moeblaze.routing import build_routing_index
from moeblaze.routing.index import build_index_dense_torch, build_index_dense_triton, build_index_sort
from helpers import check_invariants, random_routing

BUILDERS = {"sort": build_index_sort, "dense_torch": build_index_dense_torch, "dense_triton": build_index_dense_triton}
CASES = [  # (L, E, K, skew): what edge each one hits
    (1, 4, 2, "uniform"),  # a single token
    (50, 8, 1, "uniform"),  # top-1
    (40, 6, 6, "uniform"),  # K = E: every token to every expert
    (97, 13, 3, "uniform"),  # prime E, L not a multiple of any tile
    (64, 16, 2, "empty"),  # half the experts get no tokens
    (70, 8, 2, "one"),  # every token's first choice is expert 0
    (300, 64, 8, "uniform"),  # many experts, several tiles
    (33, 256, 4, "uniform"),  # E = 256: the smallest dense tile
    (6000, 256, 2, "uniform"),  # more tiles than one step of the tile scan
]


@pytest.mark.parametrize("L,E,K,skew", CASES)
@pytest.mark.parametrize("builder", list(BUILDERS))
def test_builder_invariants(builder, L, E, K, skew):
    idx = random_routing(L, E, K, skew)
    check_invariants(BUILDERS[builder](idx, E), idx)


@pytest.mark.parametrize("L,E,K,skew", CASES)
def test_dense_equals_sort_exactly(L, E, K, skew):
    idx = random_routing(L, E, K, skew)
    ref = build_index_sort(idx, E)
    for name in ("dense_torch", "dense_triton"):
        got = BUILDERS[name](idx, E)
        for a, b in zip(ref.tensors(), got.tensors()):
            assert torch.equal(a, b), name


def test_int64_ids_and_auto_method():
    idx = random_routing(20, 8, 2).long()
    a = build_routing_index(idx, 8, "auto")
    b = build_routing_index(idx, 8, "sort")
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))


def test_nbytes_is_linear_in_pairs():
    r = build_routing_index(random_routing(100, 8, 2), 8)
    assert r.nbytes() == 4 * (2 * 100 * 2 + 8 + 9)


@pytest.mark.parametrize("idx,E,match", [
    (torch.tensor([[0, 1], [2, 8]], dtype=torch.int32), 8, "outside"),
    (torch.tensor([[0, 1], [-1, 2]], dtype=torch.int32), 8, "outside"),
    (torch.tensor([[3, 3], [0, 1]], dtype=torch.int32), 8, "twice"),
    (torch.tensor([[0, 1, 2]], dtype=torch.int32), 2, "top_k"),
    (torch.tensor([0, 1], dtype=torch.int32), 4, "shape"),
    (torch.tensor([[0.0, 1.0]]), 4, "int32 or int64"),
])
@pytest.mark.parametrize("method", ["dense", "sort"])
def test_bad_routing_is_rejected(idx, E, match, method):
    with pytest.raises((ValueError, TypeError), match=match):
        build_routing_index(idx, E, method)
