"""Expert parallelism's "tokens" transport (a token crosses once per rank, the experts there gather it, one partial
sum per (token, rank) comes back) on CPU processes (gloo), the Triton kernels under the interpreter (fp32): output,
dx, the router weights' gradient and each rank's expert-weight gradients against one process over all ranks'
tokens in float64, within the project's bound (a multiple of the same computation's error in float32 torch), at
2, 4 and 8 ranks, exact and capacity dispatch, both checkpoint policies, uneven token counts, a rank without tokens,
tokens whose experts all sit on one rank, W1 in two parts, precision="fp8" (against the per-pair transport, which
equals one process bit for bit), capacity dispatch traced by torch.compile(fullgraph=True), overflow (error on every
rank, drop, a tracker's rerun), and the bytes each transport sends."""

import torch

from moeblaze import EPConfig, ExpertsConfig
from moeblaze.distributed import CapacityTracker, ep_experts
from moeblaze.distributed.plan import CapacityOverflow, Traffic
from moeblaze.experts import moe_experts
from moeblaze.routing import build_routing_index

from helpers import assert_within_torch_error, rank_problems, random_routing, run_ranks


def _problem(world, case, K=3):
    """Every rank's (x, idx, w) and the weights of all E experts (4 a rank), the same on every rank."""
    sizes = [7 + 5 * r for r in range(world)]  # uneven
    if case == "empty_rank":
        sizes[-1] = 0
    # "one_rank": every token's experts on rank 0: rank 0 gets one row per token, the others none
    route = (lambda L: random_routing(L, 4, K)) if case == "one_rank" else None
    return rank_problems(sizes, 4 * world, 16, 16, K, seed=11, route=route)


def _all(toks, i):
    return torch.cat([t[i] for t in toks])


def _one_process(toks, w1, w2, dtype, backend, dropped=None):
    """out and the gradients (x, w, w1, w2) over all ranks' tokens in one process, at `dtype`."""
    idx = _all(toks, 1)
    E = w1.shape[0]
    if dropped is not None:
        idx = torch.where(dropped, E, idx)
    ins = [t.to(dtype).requires_grad_() for t in (_all(toks, 0), _all(toks, 2), w1, w2)]
    routing = build_routing_index(idx, E, sentinels=dropped is not None)
    out = moe_experts(ins[0], routing, ins[1], ins[2], ins[3], experts=ExpertsConfig(backend=backend))
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return (out, *torch.autograd.grad(out, ins, dy.to(dtype))), dy


def _ep(rank, world, toks, w1, w2, dy, ep_config, config=None, parts=False, compiled=False, **kw):
    """out and the gradients (x, w, w1_local, w2_local) of this rank, and its slices of the whole problem."""
    E_loc = w1.shape[0] // world
    lo = sum(len(t[0]) for t in toks[:rank])
    mine, experts = slice(lo, lo + len(toks[rank][0])), slice(rank * E_loc, (rank + 1) * E_loc)
    x, idx, w = toks[rank]
    local = [x.clone().requires_grad_(), w.clone().requires_grad_(), w1[experts].clone().requires_grad_(),
             w2[experts].clone().requires_grad_()]
    config = config or ExpertsConfig(backend="triton")
    call = ep_experts
    if compiled:
        torch._dynamo.reset()
        call = torch.compile(ep_experts, fullgraph=True, backend="aot_eager")
        config = config.replace(index_method="sort")
    w1_arg = local[2]
    if parts:
        H = local[2].shape[1] // 2
        w1_arg = tuple(local[2].detach()[:, s].clone().requires_grad_() for s in (slice(0, H), slice(H, None)))
    out = call(local[0], idx, local[1], w1_arg, local[3], experts=config, ep_config=ep_config, **kw)
    if parts:
        dx, dw, dgate, dup, dw2 = torch.autograd.grad(out, [local[0], local[1], *w1_arg, local[3]],
                                                      dy[mine].to(out.dtype))
        return (out, dx, dw, torch.cat((dgate, dup), 1), dw2), mine, experts
    return (out, *torch.autograd.grad(out, local, dy[mine].to(out.dtype))), mine, experts


def _within_bound(got, same, exact, mine, experts):
    """Each of got (this rank's) within the bound against exact (float64, one process), from same's (float32 torch,
    one process) own error."""
    cut = (mine, mine, mine, experts, experts)
    for name, g, s, e, c in zip(("out", "dx", "dtopk_w", "dw1", "dw2"), got, same, exact, cut):
        try:
            assert_within_torch_error(g, s[c], e[c])
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def _compare(rank, world, case, checkpoint, dispatch):
    """dispatch: "exact" or "capacity" (64 rows a pair), "capacity_compiled" (traced whole), "/P": in P parts."""
    toks, w1, w2 = _problem(world, case)
    exact, dy = _one_process(toks, w1, w2, torch.float64, "reference")
    same, _ = _one_process(toks, w1, w2, torch.float32, "reference")
    dispatch, _, parts = dispatch.partition("/")
    capacity = dict(capacity=64) if dispatch.startswith("capacity") else {}
    ep_config = EPConfig("capacity" if capacity else "exact", transport="tokens", chunks=int(parts or 1), **capacity)
    got, mine, experts = _ep(rank, world, toks, w1, w2, dy, ep_config,
                             ExpertsConfig(backend="triton", checkpoint=checkpoint), parts=case == "w1_parts",
                             compiled=dispatch == "capacity_compiled")
    _within_bound(got, same, exact, mine, experts)


def _fp8(rank, world, checkpoint, dispatch):
    """precision="fp8": e4m3 GEMMs on the received rows; the per-pair transport equals one process bit for bit, so
    it is the reference here, and the two differ only by where the partial sums are added (float32)."""
    toks, w1, w2 = _problem(world, "uniform")
    _, dy = _one_process(toks, w1, w2, torch.float64, "reference")
    config = ExpertsConfig(backend="triton", precision="fp8", fp8_min_rows=0, checkpoint=checkpoint)
    capacity = dict(capacity=64) if dispatch == "capacity" else {}
    results = {}
    for transport in ("pairs", "tokens"):
        ep_config = EPConfig(dispatch, transport=transport, **capacity)
        results[transport], mine, experts = _ep(rank, world, toks, w1, w2, dy, ep_config, config)
    for name, a, b in zip(("out", "dx", "dtopk_w", "dw1", "dw2"), results["tokens"], results["pairs"]):
        # the partial sums' float32 rounding: a few ulps of the result's scale
        assert (a - b).abs().max() <= 8 * torch.finfo(torch.float32).eps * b.abs().max().clamp_min(1), name


def _wire(rank, world, checkpoint, dispatch, parts=1):
    """EPConfig(wire="e4m3"): x's rows and dy's cross as e4m3 with their scales. The receiver runs the op on
    dequant(q(x)) and dequant(q(dy)), so the run equals the same transport with native rows on x' and dy' so
    quantized in one process, bit for bit (dx answering for x); it sends fewer bytes than native rows, and its dW1
    (from the quantized rows) is not the native run's on x."""
    from moeblaze.experts.quant import dequantize_rows, quantize_rows

    toks, w1, w2 = _problem(world, "uniform")
    _, dy = _one_process(toks, w1, w2, torch.float64, "reference")
    config = ExpertsConfig(backend="triton", precision="fp8", fp8_min_rows=0, checkpoint=checkpoint)
    capacity = dict(capacity=64) if dispatch == "capacity" else {}

    def run(wire, toks, dy):
        Traffic.reset()
        got, _, _ = _ep(rank, world, toks, w1, w2, dy, EPConfig(dispatch, wire=wire, chunks=parts, **capacity), config)
        return got, Traffic.reset()

    def crossed(t):
        return dequantize_rows(*quantize_rows(t.float().contiguous()), torch.float32)
    got, wire_bytes = run("e4m3", toks, dy)
    want, native_bytes = run("native", [(crossed(x), idx, w) for x, idx, w in toks], crossed(dy))
    plain, _ = run("native", toks, dy)
    for name, a, b in zip(("out", "dx", "dtopk_w", "dw1", "dw2"), got, want):
        assert torch.equal(a, b), name
    assert not torch.equal(got[3], plain[3]), "dW1 took x's own rows"
    assert wire_bytes < native_bytes, (wire_bytes, native_bytes)


def _traffic(rank, world, parts=1):
    """Both transports' bytes, counted as they send, summed over the ranks: "tokens" sends each (token, rank) row
    once (in `parts` parts: the same rows), "pairs" each pair; each equals the count from the routing itself."""
    import torch.distributed as dist

    toks, w1, w2 = _problem(world, "uniform", K=4)
    _, dy = _one_process(toks, w1, w2, torch.float64, "reference")
    x, idx, _ = toks[rank]
    E_loc, D, K = w1.shape[0] // world, x.shape[1], idx.shape[1]
    dest = idx.long() // E_loc
    hit = torch.zeros(len(x), world, dtype=torch.bool).scatter_(1, dest, True)
    hit[:, rank] = False  # this rank's own block is a local copy
    # forward: the rows out and back; backward: dy out, dx back; then each transport's side data per row: the
    # pairs' router weight out and dS back (a float each), the tokens' K ids and K weights out and K dS back
    want = torch.tensor([int((dest != rank).sum()) * (4 * D * 4 + 2 * 4), int(hit.sum()) * (4 * D * 4 + 3 * K * 4)])
    sent = []
    for transport in ("pairs", "tokens"):
        Traffic.reset()
        _ep(rank, world, toks, w1, w2, dy, EPConfig(transport=transport, chunks=parts if transport == "tokens" else 1))
        sent.append(Traffic.reset())
    sent = torch.tensor(sent)
    for t in (sent, want):
        dist.all_reduce(t)
    assert torch.equal(sent, want), (sent.tolist(), want.tolist())
    assert sent[1] < sent[0]


def _overflow(rank, world, mode):
    """mode: "error", "drop" or "tracker"; "drop/P": in P parts (the same rows dropped)."""
    toks, w1, w2 = _problem(world, "one_rank")  # rank 0 gets one row per token from every rank
    small = 8
    mode, _, parts = mode.partition("/")
    x, idx, w = toks[rank]
    E_loc = w1.shape[0] // world
    if mode == "error":
        try:
            ep_experts(x, idx, w, w1[:E_loc], w2[:E_loc], experts=ExpertsConfig(backend="triton"),
                       ep_config=EPConfig("capacity", capacity=small, transport="tokens"))
        except CapacityOverflow as e:
            assert "needs more than 8 rows" in str(e), str(e)
        else:
            raise AssertionError("an overflow passed silently")
        _compare(rank, world, "one_rank", "preact", "exact")  # the group goes on
        return
    exact, dy = _one_process(toks, w1, w2, torch.float64, "reference")
    if mode == "drop":  # a source's tokens past the first 8 it sends rank 0 lose their pairs there
        dropped = torch.cat([torch.arange(len(t[0]))[:, None].expand(-1, t[1].shape[1]) >= small for t in toks])
        exact, dy = _one_process(toks, w1, w2, torch.float64, "reference", dropped)
        same, _ = _one_process(toks, w1, w2, torch.float32, "reference", dropped)
        counter = torch.zeros((), dtype=torch.int64)
        got, mine, experts = _ep(rank, world, toks, w1, w2, dy,
                                 EPConfig("capacity", capacity=small, on_overflow="drop", transport="tokens",
                                          chunks=int(parts or 1)),
                                 dropped=counter)
        _within_bound(got, same, exact, mine, experts)
        assert int(counter) == max(0, len(x) - small), (int(counter), rank)
        return
    tracker = CapacityTracker(small)  # the step overflows, grows and reruns to the one-process result
    same, _ = _one_process(toks, w1, w2, torch.float32, "reference")
    ep_config = EPConfig("capacity", transport="tokens")
    _ep(rank, world, toks, w1, w2, dy, ep_config, tracker=tracker)
    assert tracker.overflowed(), "the tracker missed the overflow"
    assert tracker.grow() >= max(len(t[0]) for t in toks)
    got, mine, experts = _ep(rank, world, toks, w1, w2, dy, ep_config, tracker=tracker)
    assert not tracker.overflowed()
    _within_bound(got, same, exact, mine, experts)


def _parts_traced(rank, world):
    """Parts pipeline eagerly: under torch.compile a clear error, not a wrong graph."""
    toks, w1, w2 = _problem(world, "uniform")
    _, dy = _one_process(toks, w1, w2, torch.float64, "reference")
    try:
        _ep(rank, world, toks, w1, w2, dy, EPConfig("capacity", capacity=64, transport="tokens", chunks=2),
            compiled=True)
    except Exception as e:  # torch.compile wraps what the traced code raises
        assert "chunks=2) pipelines the tokens transport eagerly" in str(e), str(e)
    else:
        raise AssertionError("parts under torch.compile went on")


def _cases(rank, world, errors, cases):
    for case in cases:
        try:
            kind, *args = case
            {"compare": _compare, "fp8": _fp8, "traffic": _traffic, "overflow": _overflow,
             "parts_traced": _parts_traced, "wire": _wire}[kind](rank, world, *args)
        except AssertionError as e:
            errors.put(f"rank {rank}, {case}: {e}")


def test_tokens_transport_equals_one_process_at_2_ranks():
    run_ranks(_cases, 2, [("compare", "uniform", checkpoint, dispatch)
                          for checkpoint in ("preact", "recompute") for dispatch in ("exact", "capacity")]
              + [("compare", "one_rank", "preact", "exact"), ("compare", "one_rank", "recompute", "capacity"),
                 ("compare", "empty_rank", "recompute", "exact"), ("compare", "empty_rank", "preact", "capacity")]
              + [("compare", "w1_parts", "preact", "exact"), ("compare", "uniform", "preact", "capacity_compiled"),
                 ("compare", "empty_rank", "recompute", "capacity_compiled")])


def test_tokens_transport_equals_one_process_at_4_and_8_ranks():
    run_ranks(_cases, 4, [("compare", "uniform", "preact", "exact"), ("compare", "one_rank", "preact", "capacity"),
                          ("compare", "empty_rank", "recompute", "capacity")])
    run_ranks(_cases, 8, [("compare", "empty_rank", "recompute", "capacity")])


def test_tokens_transport_fp8_matches_the_pair_transport():
    run_ranks(_cases, 2, [("fp8", "preact", "exact"), ("fp8", "recompute", "capacity")])


def test_tokens_transport_sends_e4m3_rows_where_asked():
    run_ranks(_cases, 2, [("wire", "preact", "exact"), ("wire", "recompute", "capacity"),
                          ("wire", "preact", "exact", 2)])


def test_a_wire_no_transport_sends_is_refused_by_name():
    import pytest

    from moeblaze.distributed.ep import check_ep
    with pytest.raises(ValueError, match="wire"):
        EPConfig(wire="e5m2")
    with pytest.raises(ValueError, match="wire='e4m3'.*'pairs'"):
        check_ep(EPConfig(transport="pairs", wire="e4m3"), None)
    assert check_ep(EPConfig(wire="e4m3"), None)[0].wire == "e4m3"


def test_e4m3_rows_quantize_again_to_themselves_in_bf16():
    """What wire="e4m3" relies on for precision="fp8": bf16 rows dequantized where they arrive quantize again to
    the same e4m3 values and scales, so the receiver's e4m3 GEMMs read what the sender's would."""
    from moeblaze.experts.quant import dequantize_rows, quantize_rows

    x = (torch.randn(64, 300) * torch.rand(64, 1) * 10).bfloat16()
    q, s = quantize_rows(x)
    q2, s2 = quantize_rows(dequantize_rows(q, s, torch.bfloat16))
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


def test_tokens_transport_overflow_is_never_silent():
    run_ranks(_cases, 2, [("overflow", "error"), ("overflow", "drop"), ("overflow", "tracker")])


def test_each_transport_counts_the_bytes_it_sends():
    run_ranks(_cases, 2, [("traffic",)])
    run_ranks(_cases, 4, [("traffic",)])


def _toy(rank, world, errors):
    """A transport added through the registry alone: its run and its capacity rule are what ep_experts uses."""
    from moeblaze.distributed import tokens, transports

    calls = []

    def run(call):
        calls.append(call.capacity)
        return tokens.run(call)

    toy = transports.Transport(run, lambda K, ep, E_loc: 5.0, lambda L, K, E_loc: float("inf"), tokens.rows_sent,
                               lambda K: K, sentinels=True)
    if "toy" not in transports.TRANSPORTS:
        transports.register("toy", toy)
    toks, w1, w2 = _problem(world, "uniform")
    toks = [tuple(t[:7] for t in tok) for tok in toks]  # as many tokens on every rank: capacity_factor sizes alike
    _, dy = _one_process(toks, w1, w2, torch.float64, "reference")
    got = {}
    for name in ("tokens", "toy"):
        got[name], _, _ = _ep(rank, world, toks, w1, w2, dy, EPConfig("capacity", capacity_factor=2.0, transport=name))
    assert calls == [80], calls  # its rule, not the tokens transport's (16): 2.0 x 7 tokens x 5 rows, up to 16
    for a, b in zip(got["toy"], got["tokens"]):
        assert torch.equal(a, b)


def test_a_transport_registered_by_name_runs_with_its_own_rule():
    import pytest

    from moeblaze.distributed import transports

    with pytest.raises(ValueError, match="registered as 'tokens' already"):
        transports.register("tokens", transports.TRANSPORTS["tokens"])
    with pytest.raises(ValueError, match="EPConfig.transport must be one of"):
        transports.transport("nope")
    run_ranks(_cases_toy, 2)


def _cases_toy(rank, world, errors):
    try:
        _toy(rank, world, errors)
    except AssertionError as e:
        errors.put(f"rank {rank}: {e}")


def test_tokens_transport_in_parts_equals_one_process():
    """EPConfig(chunks=P): each destination's rows in P parts, each part's all-to-alls issued without waiting and
    its experts run part by part (the weights' gradients summed over the parts): one process's results within the
    bound, exact and capacity dispatch, parts of unequal and of no rows, the same bytes, the same drops."""
    run_ranks(_cases, 2, [("compare", "uniform", "preact", "exact/2"),
                          ("compare", "uniform", "recompute", "capacity/3"),
                          ("compare", "empty_rank", "preact", "exact/2"),
                          ("compare", "one_rank", "recompute", "exact/3"),
                          ("compare", "w1_parts", "preact", "capacity/2"), ("traffic", 3), ("overflow", "drop/2"),
                          ("parts_traced",)])
    run_ranks(_cases, 4, [("compare", "uniform", "preact", "capacity/2"),
                          ("compare", "empty_rank", "recompute", "exact/3")])
