"""Token rounding's reference against constructed counts and its invariants on random routings: every expert's
count a multiple of the tile (or zero), each expert's token-choice pairs kept before any other and each group by
score, every expert within a tile of its top-k count (up: never below, down: never above), and the weight
convention (kept token-choice pairs keep their top-k weights; an added pair gets the router's weight with the
token's own normalizer)."""
import math

import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze.routing import route_topk
from moeblaze.routing.rounding import round_tokens, rounded_counts

from helpers import ROUTING_GRAD_RTOL, ROUTING_WEIGHTS_RTOL, assert_within_torch_error


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


def _dense(x, w1, w2, kept, weights, activation="swiglu"):
    """fp64: sum over the kept pairs of weight · expert(x)."""
    from moeblaze.reference import apply_activation

    E = w1.shape[0]
    return sum((weights[:, e:e + 1] * kept[:, e:e + 1]) * (apply_activation(x @ w1[e].t(), activation) @ w2[e].t())
               for e in range(E))


@pytest.mark.filterwarnings("ignore:token rounding with")
@pytest.mark.parametrize("rule,checkpoint", [("up", "preact"), ("nr-f", "recompute"), ("down", "preact")])
def test_rounded_routing_through_the_kernels(poison_alloc, rule, checkpoint):
    """The kernels (interpreter) on a rounded index: tokens with fewer and more than K experts, rows in a static
    buffer with a dropped tail; output and every gradient (x, w1, w2, and the logits through the weights) against
    the dense fp64 sum over the kept pairs."""
    from moeblaze.experts import moe_experts
    from moeblaze.routing.rounding import rounded_index

    torch.manual_seed(1)
    L, D, H, E, K, M = 90, 16, 16, 4, 2, 16
    x, w1, w2 = torch.randn(L, D), torch.randn(E, 2 * H, D) / 4, torch.randn(E, D, H) / 4
    logits = (torch.randn(L, E) * 2).requires_grad_()
    idx, w = route_topk(logits, K)
    r = round_tokens(logits, idx, w, M, rule)
    per_token = r.kept_LE.sum(1)
    if rule == "up":
        assert per_token.max() > K  # some tokens gained experts
    assert not torch.equal(r.kept_LE.sum(0), torch.bincount(idx.flatten().long(), minlength=E))  # rounding moved
    index, wk, overflow = rounded_index(r.kept_LE, r.weights_LE, 2 * K, L * K + E * M)
    assert not overflow and index.expert_token_idx.shape == (L * K + E * M + 1,)
    ins = [t.clone().requires_grad_() for t in (x, w1, w2)]
    out = moe_experts(ins[0], index, wk, ins[1], ins[2], experts=ExpertsConfig(checkpoint=checkpoint, backend="triton"))
    dy = torch.randn(L, D)

    def dense(dtype):  # the same sum in torch at dtype: its output and gradients (x, w1, w2, the logits)
        ins_d = [t.to(dtype).requires_grad_() for t in (x, w1, w2)]
        logits_d = logits.detach().to(dtype).requires_grad_()
        idx_d, w_d = route_topk(logits_d, K)
        r_d = round_tokens(logits_d, idx_d, w_d, M, rule)
        assert torch.equal(r_d.kept_LE, r.kept_LE)
        ref = _dense(*ins_d, r.kept_LE, r_d.weights_LE.to(dtype))
        return (ref, *torch.autograd.grad(ref, ins_d + [logits_d], dy.to(dtype)))
    got = (out, *torch.autograd.grad(out, ins + [logits], dy))
    for a, same, exact in zip(got, dense(torch.float32), dense(torch.float64)):  # out, dx, dw1, dw2, dlogits
        assert_within_torch_error(a, same, exact)


def test_rounded_index_reports_overflow():
    from moeblaze.routing.rounding import rounded_index

    kept = torch.tensor([[True, True, True], [True, False, False]])
    w = torch.rand(2, 3)
    _, _, over = rounded_index(kept, w, 2, 8)  # token 0 has 3 experts, the table 2
    assert bool(over)
    _, _, over = rounded_index(kept, w, 3, 3)  # 4 pairs, 3 rows
    assert bool(over)
    index, wk, over = rounded_index(kept, w, 3, 4)
    assert not over and index.expert_offsets.tolist() == [0, 2, 3, 4]
    assert index.token_slot.tolist() == [[0, 2, 3], [1, 4, 4]]  # the empty place points to the spare last row
    assert torch.equal(wk[0], w[0]) and wk[1].tolist() == [w[1, 0].item(), 0.0, 0.0]


def _rounded_index_by_loops(kept, w, max_experts, max_rows):
    """rounded_index's contract written as loops: expert-major rows of the pairs that fit (a pair fits where its
    place among its token's experts is < max_experts and its row, counted over every kept pair, < max_rows)."""
    L, E = kept.shape
    place = {(t, e): k for t in range(L) for k, e in enumerate(e for e in range(E) if kept[t, e])}
    pairs = [(t, e) for e in range(E) for t in range(L) if kept[t, e]]
    fits = [(t, e) for r, (t, e) in enumerate(pairs) if r < max_rows and place[t, e] < max_experts]
    fits.sort(key=lambda p: (p[1], p[0]))
    eti, slot = [0] * (max_rows + 1), [[max_rows] * max_experts for _ in range(L)]
    wk = [[0.0] * max_experts for _ in range(L)]
    for r, (t, e) in enumerate(fits):
        eti[r] = t
        slot[t][place[t, e]], wk[t][place[t, e]] = r, float(w[t, e])
    counts = [sum(1 for _, e in fits if e == x) for x in range(E)]
    return counts, eti, slot, wk, len(fits) < len(pairs)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_rounded_index_equals_its_contract_written_as_loops(impl):
    """Random masks (empty tokens, empty experts, tables and row bounds that overflow or not, several token tiles
    of the kernels) and L = 0, through the torch ops and the kernels (interpreter)."""
    from moeblaze.routing import rounding

    build = rounding._rounded_index_torch if impl == "torch" else rounding._rounded_index_triton
    g = torch.Generator().manual_seed(3)
    for L, E, p, max_experts, max_rows in ((40, 6, 0.3, 3, 100), (40, 6, 0.5, 2, 60), (33, 5, 0.6, 5, 50),
                                           (17, 9, 0.1, 4, 3), (0, 4, 0.5, 2, 4), (300, 64, 0.05, 4, 1500),
                                           (300, 64, 0.08, 3, 1000), (260, 40, 0.1, 6, 600)):
        if L == 0 and impl == "triton":
            continue  # rounded_index takes the torch ops for an empty batch
        kept = torch.rand(L, E, generator=g) < p
        kept[5:6] = False  # a token without experts
        w = torch.rand(L, E, generator=g)
        index, wk, over = build(kept, w, max_experts, max_rows)
        counts, eti, slot, wk_want, over_want = _rounded_index_by_loops(kept, w, max_experts, max_rows)
        assert index.expert_counts.tolist() == counts and bool(over) == over_want
        assert index.expert_offsets.tolist() == [0] + torch.tensor(counts, dtype=torch.long).cumsum(0).tolist()
        assert index.expert_token_idx.tolist() == eti and index.token_slot.tolist() == slot
        assert wk.tolist() == wk_want


@pytest.mark.filterwarnings("ignore:token rounding with")
@pytest.mark.parametrize("scoring", ["softmax_topk", "sigmoid_topk", "topk_softmax"])
def test_fast_rounding_equals_the_reference(scoring):
    """Two column-wise top-(M - 1) selections give the reference's kept pairs and weights (continuous random scores:
    no ties), for every rule, including a tile larger than the batch."""
    from moeblaze.routing.rounding import round_tokens_fast

    torch.manual_seed(5)
    for L, E, K, M in ((256, 8, 2, 16), (300, 16, 4, 32), (64, 4, 1, 16), (2048, 64, 4, 128), (100, 4, 2, 128)):
        for rule in ("nr-f", "up", "down"):
            logits = torch.randn(L, E) * 2
            idx, w = route_topk(logits, K, scoring)
            a, b = round_tokens(logits, idx, w, M, rule, scoring), round_tokens_fast(logits, idx, w, M, rule, scoring)
            assert torch.equal(a.kept_LE, b.kept_LE), (L, E, K, M, rule)
            assert torch.equal(a.weights_LE, b.weights_LE) and torch.equal(a.counts_E, b.counts_E)


def test_rounded_rows_bound_per_rule():
    """L·K plus each expert's largest rise (under half a tile for nr-f, under a tile for up, none for down), capped
    at L·E."""
    from moeblaze.routing.rounding import rounded_rows_bound

    assert [rounded_rows_bound(100, 2, 4, 16, r) for r in ("nr-f", "up", "down")] == [232, 260, 200]
    assert rounded_rows_bound(100, 2, 4, 128, "up") == 400  # L·E: no expert can keep more than every token


@pytest.mark.filterwarnings("ignore:token rounding with")
@pytest.mark.parametrize("rule", ["nr-f", "up"])
def test_max_experts_bounds_experts_per_token(rule):
    """Tokens that score high for every expert (sigmoid scores allow it) would be every rising expert's first
    addition; with max_experts, each expert that added a pair to a token over the bound rounds down instead:
    no token over it, counts still multiples of the tile, the other experts as without the bound; the fast
    rounding gives the reference's result."""
    from moeblaze.routing.rounding import round_tokens_fast

    torch.manual_seed(7)
    L, E, K, M, cap = 256, 16, 2, 16, 4
    logits = torch.randn(L, E)
    logits[:3] += 6.0  # three tokens near the top of every column
    idx, w = route_topk(logits, K, "sigmoid_topk")
    free = round_tokens(logits, idx, w, M, rule, "sigmoid_topk")
    assert free.kept_LE.sum(1).max() > cap  # the bound matters here
    got = round_tokens(logits, idx, w, M, rule, "sigmoid_topk", max_experts=cap)
    assert torch.equal(got.kept_LE, round_tokens_fast(logits, idx, w, M, rule, "sigmoid_topk", max_experts=cap).kept_LE)
    assert got.kept_LE.sum(1).max() <= cap
    assert torch.all(got.counts_E % M == 0)
    chosen = torch.zeros(L, E, dtype=torch.bool).scatter_(1, idx.long(), True)
    f = chosen.sum(0)
    over = free.kept_LE.sum(1) > cap
    gave = (free.kept_LE & ~chosen & over[:, None]).any(0)
    assert gave.any() and not gave.all()
    assert torch.equal(got.counts_E[gave], f[gave] // M * M)  # rounded down
    assert torch.equal(got.kept_LE[:, ~gave], free.kept_LE[:, ~gave])  # the others untouched
    assert not (got.kept_LE & ~free.kept_LE).any()  # a subset of the unbounded pairs, with their weights
    assert torch.equal(got.weights_LE, torch.where(got.kept_LE, free.weights_LE, 0.0))
    with pytest.raises(ValueError, match="max_experts"):
        round_tokens(logits, idx, w, M, rule, "sigmoid_topk", max_experts=K - 1)


SCORINGS = ("softmax_topk", "sigmoid_topk", "topk_softmax")


@pytest.mark.filterwarnings("ignore:token rounding with")
@pytest.mark.parametrize("scoring", SCORINGS)
def test_round_to_index_equals_rounding_then_index(poison_alloc, scoring):
    """The rounding kernels (interpreter) against rounded_index(round_tokens_fast(...)) in torch ops, fresh buffers
    NaN: the same index and overflow, the weights to fp32 rounding, and the logits' gradient through the weights
    (the top-k weights' path included) to 1e-5; every rule, with the bound on experts per token binding (tokens
    that score high everywhere), several token tiles, a tile larger than the batch, and without renormalization.
    Each scoring runs every rule and every shape, each rule on another shape (a Latin square over the scorings:
    every (rule, shape) and (scoring, rule) pair is run, a third of the full product's interpreted runs)."""
    from moeblaze.routing import round_to_index
    from moeblaze.routing.rounding import round_tokens_fast
    from moeblaze.routing.rounding import _rounded_index_torch

    torch.manual_seed(11)
    shapes = ((300, 16, 4, 32, 8, False), (256, 16, 2, 16, 4, True), (100, 4, 2, 128, 4, False))
    shift = SCORINGS.index(scoring)
    cases = [(True, rule, shapes[(shift + j) % 3]) for j, rule in enumerate(("nr-f", "up", "down"))]
    for renorm, rule, (L, E, K, M, cap, hot) in cases + [(False, "up", (256, 16, 2, 16, 4, True))]:
        logits = torch.randn(L, E) * 2
        if hot:
            logits[:3] += 6.0
        logits.requires_grad_()
        idx, w = route_topk(logits, K, scoring, renormalize=renorm, route_scale=1.5)
        rows = L * K + E * M
        rr = round_tokens_fast(logits, idx, w, M, rule, scoring, renorm, 1.5, max_experts=cap)
        want = _rounded_index_torch(rr.kept_LE, rr.weights_LE, cap, rows)
        got = round_to_index(logits, idx, w, M, rule, scoring, renorm, 1.5, max_experts=cap, max_rows=rows)
        case = (renorm, rule, L, E, K, M)
        for f in ("expert_counts", "expert_offsets", "expert_token_idx", "token_slot"):
            assert torch.equal(getattr(got[0], f), getattr(want[0], f)), (f, case)
        assert bool(got[2]) == bool(want[2]) is False
        torch.testing.assert_close(got[1], want[1], rtol=ROUTING_WEIGHTS_RTOL, atol=0)
        dw = torch.randn(L, cap)
        g_want = torch.autograd.grad((want[1] * dw).sum(), logits, retain_graph=True)[0]
        g_got = torch.autograd.grad((got[1] * dw).sum(), logits)[0]
        assert float((g_got - g_want).norm()) <= ROUTING_GRAD_RTOL * float(g_want.norm()), case


@pytest.mark.filterwarnings("ignore:token rounding with")
def test_round_to_index_breaks_ties_as_the_reference():
    """Scores with many exact ties (sigmoid of integer logits): the kernels' radix select adds the earliest of
    equally scored tokens first and drops the latest first, the reference's stable sort, so their index equals
    the reference's exactly (round_tokens_fast's top-k may break such ties either way)."""
    from moeblaze.routing import round_to_index
    from moeblaze.routing.rounding import rounded_index

    torch.manual_seed(2)
    for rule, cap in (("nr-f", 8), ("up", 3), ("down", 8)):
        logits = torch.randint(-3, 4, (300, 8)).float()
        idx, w = route_topk(logits, 2, "sigmoid_topk")
        ref = round_tokens(logits, idx, w, 16, rule, "sigmoid_topk", max_experts=cap)
        want = rounded_index(ref.kept_LE, ref.weights_LE, cap, 300 * 2 + 8 * 16)
        got = round_to_index(logits, idx, w, 16, rule, "sigmoid_topk", max_experts=cap, max_rows=300 * 2 + 8 * 16)
        for f in ("expert_counts", "expert_token_idx", "token_slot"):
            assert torch.equal(getattr(got[0], f), getattr(want[0], f)), (f, rule)
        torch.testing.assert_close(got[1], want[1], rtol=ROUTING_WEIGHTS_RTOL, atol=0)


@pytest.mark.filterwarnings("ignore:token rounding with")
def test_round_to_index_on_cpu_tensors_is_rounding_then_index(monkeypatch):
    """Without the interpreter, CPU tensors take the torch ops: exactly rounded_index(round_tokens_fast(...))."""
    from moeblaze.routing import round_to_index
    from moeblaze.routing.rounding import round_tokens_fast, rounded_index
    from moeblaze.routing import rounding

    monkeypatch.setattr(rounding, "INTERPRET", False)
    logits = torch.randn(300, 16) * 2
    idx, w = route_topk(logits, 4)
    got = round_to_index(logits, idx, w, 32, "up", max_experts=8, max_rows=300 * 4 + 16 * 32)
    rr = round_tokens_fast(logits, idx, w, 32, "up", max_experts=8)
    want = rounded_index(rr.kept_LE, rr.weights_LE, 8, 300 * 4 + 16 * 32)
    assert all(torch.equal(a, b) for a, b in zip(got[0].tensors(), want[0].tensors()))
    assert torch.equal(got[1], want[1]) and bool(got[2]) == bool(want[2]) is False


@pytest.mark.parametrize("L,E,K,tile,rule", [(16, 4, 1, 8, "nr-f"), (12, 4, 2, 8, "up"), (1, 4, 2, 16, "nr-f")])
def test_rounded_layer_backward_where_the_row_bound_passes_the_table(poison_alloc, L, E, K, tile, rule):
    """Small batches whose rounded row bound (L·K plus each expert's largest rise) exceeds the table's L ·
    rounding_max_experts slots (rounding_max_experts = K): the kernels' backward placed the router weights by slot
    into an array of the table's size and raised IndexError. The layer's output and every gradient against the
    reference on the same rounded index. The router does not renormalize: a renormalized top-1 weight is p / p = 1,
    whose gradient is zero in exact arithmetic, so the router's gradient would be the aux loss's beside rounding
    noise of terms that cancel, a relative error of that noise and no measure of either path."""
    import warnings

    from moeblaze import ExpertsConfig, MoELayer, RoundingConfig, RouterConfig

    def run(backend, dtype=torch.float32):
        torch.manual_seed(3)
        layer = MoELayer(16, 8, E, K, experts=ExpertsConfig(backend=backend), router=RouterConfig(renormalize=False),
                         rounding=RoundingConfig(rule, tile=tile, max_experts=K)).to(dtype)
        x = torch.randn(L, 16).to(dtype).requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fewer than 2 tiles of tokens per expert: said, and meant here
            out, aux, _ = layer(x)
        (out.square().sum() + aux).backward()
        return [out, x.grad] + [p.grad for p in layer.parameters()]

    from helpers import assert_within_torch_error

    got, ref, want = run("triton"), run("reference"), run("reference", torch.float64)
    assert bool(want[0].abs().sum() > 0) == (L > 1)  # pairs kept, except at L = 1, where rounding drops every pair
    for g, r, w in zip(got, ref, want):
        assert_within_torch_error(g, r, w)


@pytest.mark.parametrize("L,rule,tile,says", [(12, "up", 16, "every pair is dropped"),
                                              (16, "nr-f", 64, "most pairs (all, where every expert is below it)"),
                                              (48, "nr-f", 16, "changes the routing a lot")])
def test_rounding_on_a_small_batch_says_what_it_drops(L, rule, tile, says):
    """Fewer than half a tile of pairs per expert (nr-f), or fewer tokens than a tile (up): the rounding drops most
    or all pairs; the warning says so, and the layer's output is then what was kept (zero where all were dropped)."""
    from moeblaze import MoELayer, RoundingConfig

    torch.manual_seed(0)
    layer = MoELayer(16, 8, 4, 2, rounding=RoundingConfig(rule, tile=tile))
    with pytest.warns(UserWarning, match="token rounding with") as caught:
        out, _, _ = layer(torch.randn(L, 16))
    assert says in str(caught[0].message)
    if says == "every pair is dropped":
        assert not out.any()
