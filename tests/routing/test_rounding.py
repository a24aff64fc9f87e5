"""Token rounding's reference against constructed counts and its invariants on random routings: every expert's
count a multiple of the tile (or zero), each expert's token-choice pairs kept before any other and each group by
score, every expert within a tile of its top-k count (up: never below, down: never above), and the weight
convention (kept token-choice pairs keep their top-k weights; an added pair gets the router's weight with the
token's own normalizer)."""
import math

import pytest
import torch

from moeblaze.routing import route_topk
from moeblaze.routing.rounding import round_tokens, rounded_counts


def test_nearest_rule_on_constructed_counts():
    f = torch.tensor([5, 6, 3, 2, 0, 8, 7])
    # tile 4: 5 -> 4 (1 below vs 3 above), 6 -> 4 (a tie goes down), 3 -> 4, 2 -> 0 (tie), 0, 8, 7 -> 8
    assert rounded_counts(f, 4, "nr-f").tolist() == [4, 4, 4, 0, 0, 8, 8]
    assert rounded_counts(f, 4, "up").tolist() == [8, 8, 4, 4, 0, 8, 8]
    assert rounded_counts(f, 4, "down").tolist() == [4, 4, 0, 0, 0, 8, 4]
    assert rounded_counts(torch.tensor([9]), 4, "up", num_tokens=10).tolist() == [8]  # 12 would exceed L


def _check(logits, idx, w, tile, rule, scoring="softmax_topk"):
    L, E = logits.shape
    r = round_tokens(logits, idx, w, tile, rule, scoring)
    chosen = torch.zeros(L, E, dtype=torch.bool).scatter_(1, idx.long(), True)
    f = chosen.sum(0)
    assert torch.all(r.counts_E % tile == 0)
    assert torch.all((r.counts_E - f).abs() < tile)
    if rule == "up":
        assert torch.all(r.counts_E >= torch.where(-(-f // tile) * tile > L, f // tile * tile, f))
    if rule == "down":
        assert torch.all(r.counts_E <= f)
    s = logits.softmax(-1) if scoring != "sigmoid_topk" else logits.sigmoid()
    for e in range(E):
        tc, other = chosen[:, e], ~chosen[:, e]
        kept = r.kept_LE[:, e]
        if (kept & other).any():  # added pairs only once every token-choice pair is kept
            assert kept[tc].all()
        if (tc & ~kept).any():  # dropped token-choice pairs: nothing added
            assert not (kept & other).any()
        for group in (tc, other):  # within each group, the kept ones score at least the others
            k, d = s[group & kept, e], s[group & ~kept, e]
            if len(k) and len(d):
                assert k.min() >= d.max()
    return r, chosen


@pytest.mark.filterwarnings("ignore:token rounding with")
@pytest.mark.parametrize("rule", ["nr-f", "up", "down"])
@pytest.mark.parametrize("scoring", ["softmax_topk", "sigmoid_topk"])
def test_invariants_on_random_routings(rule, scoring):
    torch.manual_seed(3)
    for L, E, K, tile in ((256, 8, 2, 16), (300, 16, 4, 32), (64, 4, 1, 16)):
        logits = torch.randn(L, E) * 2
        idx, w = route_topk(logits, K, scoring)
        r, chosen = _check(logits, idx, w, tile, rule, scoring)
        kept_tc = r.kept_LE & chosen
        full = torch.zeros(L, E).scatter(1, idx.long(), w)
        assert torch.equal(r.weights_LE[kept_tc], full[kept_tc])  # token-choice weights unchanged
        assert torch.all(r.weights_LE[~r.kept_LE] == 0)


@pytest.mark.filterwarnings("ignore:token rounding with")
def test_added_pairs_weight_with_the_token_s_normalizer():
    # 4 tokens, 2 experts, K = 1, tile 2: expert 0 is chosen by 3 tokens, expert 1 by 1; "up" gives each 4... and 2
    logits = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.5, 0.0], [0.0, 3.0]])
    idx, w = route_topk(logits, 1, "softmax_topk", renormalize=True, route_scale=2.0)
    r = round_tokens(logits, idx, w, 2, "up", "softmax_topk", renormalize=True, route_scale=2.0)
    assert r.counts_E.tolist() == [4, 2]
    # token 3 is added to expert 0 (the only one left); expert 1 adds token 2 (best of the others: 1 - s[t, 0])
    assert r.kept_LE.tolist() == [[True, False], [True, False], [True, True], [True, True]]
    s = logits.softmax(-1)
    assert torch.allclose(r.weights_LE[3, 0], 2.0 * s[3, 0] / s[3, 1])  # s[t, e] / the token's chosen sum, scaled
    assert torch.allclose(r.weights_LE[2, 1], 2.0 * s[2, 1] / s[2, 0])
    assert torch.allclose(r.weights_LE[0, 0], torch.tensor(2.0))  # renormalized top-1 weight, scaled


def test_warns_below_two_tiles_per_expert():
    logits = torch.randn(64, 8)
    idx, w = route_topk(logits, 2)
    with pytest.warns(UserWarning, match="fewer than 2 tiles"):
        round_tokens(logits, idx, w, 16)
    assert math.isfinite(float(round_tokens(torch.randn(512, 4), *route_topk(torch.randn(512, 4), 2), 16)
                               .weights_LE.sum()))
