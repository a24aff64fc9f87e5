"""Expert parallelism's per-pair transport (EPConfig(transport="pairs")) on CPU processes (gloo, 127.0.0.1): the
receiver index's order, and the EP layer at 2 and 4
ranks against one process over all ranks' tokens, bitwise (torch.equal) on the Triton kernels under the
interpreter (fp32): output, dx, the router weights' gradient and each rank's expert-weight gradients, under both
checkpoint policies and both dispatch modes (precision="fp8" and checkpoint="preact-fp8" too), with skewed
routing, empty experts, a rank without tokens and a rank that receives nothing; capacity dispatch also under
torch.compile(fullgraph=True). Capacity overflow: an error by default (every rank), dropped pairs equal to one
process that drops them, and a tracker's rerun at the capacity it asks for equal to one process."""

import torch

from moeblaze import EPConfig, ExpertsConfig
from moeblaze.distributed import CapacityTracker, ep_experts, receiver_index
from moeblaze.distributed.plan import CapacityOverflow
from moeblaze.experts import moe_experts
from moeblaze.routing import build_routing_index

from helpers import rank_problems, random_routing, run_ranks


def _pairs(*args, **kw) -> EPConfig:
    """The per-pair transport's EPConfig: the one whose results equal one process bit for bit."""
    return EPConfig(*args, transport="pairs", **kw)


PAIRS = _pairs()


def _cases(rank, world, errors, cases):
    """Every (case, checkpoint, dispatch) in one process group: spawning and importing cost more than the cases."""
    for case, checkpoint, dispatch in cases:
        try:
            if dispatch.startswith(("overflow", "uneven")):
                _overflow(rank, world, dispatch)
            else:
                _compare(rank, world, case, checkpoint, dispatch)
        except AssertionError as e:  # reported to the parent, which fails the test; the ranks go on together
            errors.put(f"rank {rank}, {case}, {checkpoint}, {dispatch}: {e}")


def _problem(world, case):
    """Every rank's tokens (a list of (x, idx, w)) and the weights of all E experts; the same on every rank."""
    E, D, H, K = (3 if case == "three_local" else 2) * world, 16, 16, 2  # "three_local": 3 experts a rank
    # "w1_parts": "uniform", W1's gate and up rows passed as two tensors
    sizes = [9 + 4 * r for r in range(world)]
    if case == "empty_rank":
        sizes[-1] = 0
    route = None
    if case == "skewed":  # every token to the first rank's experts: the others receive nothing
        def route(L):
            return random_routing(L, 2, K)
    elif case == "empty_experts":  # experts 1 and E - 1 never chosen
        pool = torch.tensor([e for e in range(E) if e not in (1, E - 1)])

        def route(L):
            return torch.stack([pool[torch.randperm(len(pool))[:K]] for _ in range(L)])
    toks, w1, w2 = rank_problems(sizes, E, D, H, K, seed=7, route=route)
    if case == "masters":  # float16 x, float32 weights
        toks = [(x.half(), idx, w) for x, idx, w in toks]
    return toks, w1, w2


def _config(recipe: str, **kw) -> ExpertsConfig:
    """A case's recipe: a checkpoint policy, or "fp8-" and one (precision="fp8")."""
    fp8 = recipe.startswith("fp8-")
    fp8_fields = dict(precision="fp8", fp8_min_rows=0) if fp8 else {}
    return ExpertsConfig(checkpoint=recipe.removeprefix("fp8-"), **fp8_fields, **kw)


def _one_process(toks, w1, w2, checkpoint, dropped=None):
    """out and the gradients (x, w, w1, w2) of one process over all ranks' tokens; `dropped` (pairs) go to no
    expert, as sentinels."""
    x_all, idx_all, w_all = (torch.cat([t[i] for t in toks]) for i in range(3))
    E = w1.shape[0]
    if dropped is not None:
        idx_all = torch.where(dropped, E, idx_all)
    ins = [t.clone().requires_grad_() for t in (x_all, w_all, w1, w2)]
    routing = build_routing_index(idx_all, E, sentinels=dropped is not None)
    out_all = moe_experts(ins[0], routing, ins[1], ins[2], ins[3], experts=_config(checkpoint, backend="triton"))
    dy_all = torch.randn(out_all.shape, generator=torch.Generator().manual_seed(3)).to(out_all.dtype)
    return out_all, torch.autograd.grad(out_all, ins, dy_all), dy_all


def _ep(rank, world, toks, w1, w2, checkpoint, dy_all, **kw):
    """out and the gradients (x, w, w1_local, w2_local) of this rank under expert parallelism; parts=True: W1's gate
    and up rows go in as two tensors (torchtitan's w1 and w3), their gradients joined for the comparison."""
    parts = kw.pop("parts", False)
    E_loc = w1.shape[0] // world
    lo = sum(len(t[0]) for t in toks[:rank])
    mine = slice(lo, lo + len(toks[rank][0]))
    experts = slice(rank * E_loc, (rank + 1) * E_loc)
    x, idx, w = toks[rank]
    local = [x.clone().requires_grad_(), w.clone().requires_grad_(), w1[experts].clone().requires_grad_(),
             w2[experts].clone().requires_grad_()]
    call = ep_experts
    if kw.pop("compiled", False):  # traced whole by torch.compile: the capacity path's custom ops (the index by
        # sort: dynamo can't trace the interpreter's launch of the dense builder; the same index either way)
        torch._dynamo.reset()
        call = torch.compile(ep_experts, fullgraph=True, backend="aot_eager")
        config = _config(checkpoint, index_method="sort")
    else:
        config = _config(checkpoint)
    if parts:
        H = local[2].shape[1] // 2
        gate, up = (local[2].detach()[:, s].clone().requires_grad_() for s in (slice(0, H), slice(H, None)))
        out = call(local[0], idx, local[1], (gate, up), local[3], experts=config, **kw)
        dx, dw, dgate, dup, dw2 = torch.autograd.grad(out, [local[0], local[1], gate, up, local[3]], dy_all[mine])
        return out, (dx, dw, torch.cat((dgate, dup), 1), dw2), mine, experts
    out = call(local[0], idx, local[1], local[2], local[3], experts=config, **kw)
    return out, torch.autograd.grad(out, local, dy_all[mine]), mine, experts


def _assert_equal(got, want, mine, experts):
    out, g = got
    out_all, g_all = want
    assert torch.equal(out, out_all[mine]), "out"
    for name, a, b in zip(("dx", "dtopk_w", "dw1", "dw2"), g,
                          (g_all[0][mine], g_all[1][mine], g_all[2][experts], g_all[3][experts])):
        assert torch.equal(a, b), name


def _compare(rank, world, case, checkpoint, dispatch):
    toks, w1, w2 = _problem(world, case)
    out_all, g_all, dy_all = _one_process(toks, w1, w2, checkpoint)
    kw = dict(parts=case == "w1_parts")
    if dispatch.startswith("capacity"):  # 48: more than any rank sends
        kw.update(ep_config=PAIRS.replace(dispatch="capacity", capacity=48), compiled=dispatch == "capacity_compiled")
    elif dispatch.startswith("exact_chunks"):  # the local experts in groups, their all-to-alls pipelined
        kw.update(ep_config=PAIRS.replace(chunks=int(dispatch.removeprefix("exact_chunks"))))
    else:
        kw.update(ep_config=PAIRS)
    out, g, mine, experts = _ep(rank, world, toks, w1, w2, checkpoint, dy_all, **kw)
    _assert_equal((out, g), (out_all, g_all), mine, experts)


def _dropped_pairs(toks, E, world, capacity):
    """(L_all, K) bool: the pairs past `capacity` in their destination's expert order, rank by rank."""
    E_loc, out = E // world, []
    for _x, idx, _ in toks:
        r = build_routing_index(idx, E)
        first = r.expert_offsets[:-1].view(world, E_loc)[:, 0].long()
        row = r.token_slot.long()
        dest = torch.searchsorted(first, row, right=True) - 1
        out.append(row - first[dest] >= capacity)
    return torch.cat(out)


def _overflow(rank, world, mode):
    toks, w1, w2 = _problem(world, "skewed")  # every token to rank 0's experts: rank 0 receives the most
    small = 8
    if mode == "uneven_factor":  # ranks of 9 and 13 tokens: capacity_factor alone sizes 16 and 32 rows
        toks, w1, w2 = _problem(world, "uniform")
        x, idx, w = toks[rank]
        E_loc = w1.shape[0] // world
        try:
            ep_experts(x, idx, w, w1[:E_loc], w2[:E_loc], ep_config=_pairs("capacity", capacity_factor=1.25))
        except ValueError as e:
            assert "different capacities" in str(e) and "capacity=" in str(e), str(e)
        else:
            raise AssertionError("ranks with different capacities went on")
        # the same ranks then agree on an explicit capacity, and the group is still usable
        out_all, g_all, dy_all = _one_process(toks, w1, w2, "preact")
        out, g, mine, experts = _ep(rank, world, toks, w1, w2, "preact", dy_all,
                                    ep_config=_pairs("capacity", capacity=48))
        _assert_equal((out, g), (out_all, g_all), mine, experts)
    elif mode == "overflow_error":
        x, idx, w = toks[rank]
        E_loc = w1.shape[0] // world
        try:
            ep_experts(x, idx, w, w1[:E_loc], w2[:E_loc], ep_config=_pairs("capacity", capacity=small))
        except CapacityOverflow as e:
            assert "needs more than 8 rows" in str(e) and "no row was sent" in str(e), str(e)
        else:
            raise AssertionError("an overflow passed silently")
        # every rank raised together: the group goes on, the same step in exact dispatch equals one process
        out_all, g_all, dy_all = _one_process(toks, w1, w2, "preact")
        out, g, mine, experts = _ep(rank, world, toks, w1, w2, "preact", dy_all)
        _assert_equal((out, g), (out_all, g_all), mine, experts)
    elif mode == "overflow_drop":
        dropped = _dropped_pairs(toks, w1.shape[0], world, small)
        assert dropped.any()
        out_all, g_all, dy_all = _one_process(toks, w1, w2, "preact", dropped)
        counter = torch.zeros((), dtype=torch.int64)
        out, g, mine, experts = _ep(rank, world, toks, w1, w2, "preact", dy_all,
                                    ep_config=_pairs("capacity", capacity=small, on_overflow="drop"),
                                    dropped=counter)
        _assert_equal((out, g), (out_all, g_all), mine, experts)
        lo = sum(len(t[0]) for t in toks[:rank])  # this rank's pairs dropped, as the count says
        assert int(counter) == int(dropped[lo:lo + len(toks[rank][0])].sum()), (int(counter), rank)
    else:  # a tracker: the step overflows, grows and reruns to the one-process result
        tracker = CapacityTracker(small)
        out_all, g_all, dy_all = _one_process(toks, w1, w2, "recompute")
        _ep(rank, world, toks, w1, w2, "recompute", dy_all, ep_config=_pairs("capacity"), tracker=tracker)
        assert tracker.overflowed(), "the tracker missed the overflow"
        assert tracker.grow() >= max(len(t[0]) for t in toks) * 2 and tracker.capacity % 16 == 0
        out, g, mine, experts = _ep(rank, world, toks, w1, w2, "recompute", dy_all,
                                    ep_config=_pairs("capacity"), tracker=tracker)
        assert not tracker.overflowed()
        _assert_equal((out, g), (out_all, g_all), mine, experts)


def _run(world, cases):
    run_ranks(_cases, world, cases)


def test_ep2_equals_one_process_bitwise():
    _run(2, [(case, checkpoint, dispatch) for case in ("uniform", "skewed", "empty_experts", "empty_rank")
             for checkpoint in ("preact", "recompute") for dispatch in ("exact", "capacity")]
         + [("uniform", "preact", "capacity_compiled"), ("empty_rank", "recompute", "capacity_compiled"),
            ("w1_parts", "preact", "exact"), ("w1_parts", "recompute", "capacity_compiled")])


def test_ep2_fp8_and_preact_fp8_equal_one_process_bitwise():
    """precision="fp8" and checkpoint="preact-fp8" under expert parallelism: the same op on the received rows, so
    equal to one process bit for bit, in both dispatch modes (and capacity traced by torch.compile); also on float32
    master weights of a float16 x (quantized where they lie, their gradients float32)."""
    _run(2, [("uniform", "preact-fp8", "exact"), ("empty_rank", "preact-fp8", "capacity"),
             ("skewed", "fp8-preact", "exact"), ("empty_experts", "fp8-recompute", "capacity"),
             ("uniform", "fp8-preact-fp8", "exact"), ("uniform", "fp8-preact", "capacity_compiled"),
             ("masters", "fp8-preact", "exact"), ("masters", "fp8-recompute", "capacity")])


def test_ep4_equals_one_process_bitwise():
    _run(4, [("empty_experts", "recompute", "exact"), ("empty_rank", "preact", "exact"),
             ("uniform", "recompute", "capacity")])


def test_ep_with_expert_groups_pipelined_equals_one_process_bitwise():
    """EPConfig(chunks=G): the local experts in G groups, each group's all-to-alls issued without waiting and its
    GEMMs run between them; the same rows reach each expert in the same order, so the results equal one process
    bit for bit (and the one-group path, which equals it too): skewed routing (ranks that receive nothing), empty
    experts (a group without rows), a rank without tokens, W1 in two parts, groups of unequal size (3 experts in
    2 groups), and the fp8 recipes."""
    _run(2, [("uniform", "preact", "exact_chunks2"), ("skewed", "recompute", "exact_chunks2"),
             ("empty_experts", "preact", "exact_chunks2"), ("empty_rank", "recompute", "exact_chunks2"),
             ("w1_parts", "preact", "exact_chunks2"), ("three_local", "preact", "exact_chunks2"),
             ("three_local", "recompute", "exact_chunks3"), ("uniform", "fp8-preact", "exact_chunks2"),
             ("uniform", "preact-fp8", "exact_chunks2"), ("masters", "fp8-preact", "exact_chunks2")])
    _run(4, [("empty_experts", "preact", "exact_chunks2"), ("three_local", "recompute", "exact_chunks3")])


def test_capacity_overflow_is_never_silent():
    _run(2, [(None, None, "overflow_error"), (None, None, "overflow_drop"), (None, None, "overflow_tracker")])


def test_capacity_by_factor_on_uneven_ranks_is_an_error_on_every_rank():
    """Ranks with different token counts size different capacities from capacity_factor: a ValueError naming the
    fix on every rank before any row is sent (not gloo's abort or NCCL's mismatched collectives)."""
    _run(2, [(None, None, "uneven_factor")])


class _OnlyTheProtocol:
    """A transport that forwards to another and exposes nothing but plan.Transport's members: the op's bodies
    running on it, equal, show that they use the seam and nothing behind it."""

    def __init__(self, inner, calls):
        self._inner, self._calls = inner, calls
        for name in ("routing", "groups", "slot_LK", "kept", "needed"):
            setattr(self, name, getattr(inner, name))

    def _forward(name):
        def method(self, *args):
            self._calls[name] = self._calls.get(name, 0) + 1
            return getattr(self._inner, name)(*args)
        return method

    tensors = _forward("tensors")
    in_send_order = _forward("in_send_order")
    send = _forward("send")
    dispatch_groups = _forward("dispatch_groups")
    dispatch = _forward("dispatch")
    return_buffer = _forward("return_buffer")
    give_back_group = _forward("give_back_group")
    give_back = _forward("give_back")
    combine = _forward("combine")
    del _forward


def _through_the_protocol(rank, world, dispatch):
    from moeblaze.distributed import pairs as ep_module

    calls = {}
    made, restored = ep_module.make_plan, ep_module.restore_plan
    ep_module.make_plan = lambda *a: _OnlyTheProtocol(made(*a), calls)
    ep_module.restore_plan = lambda *a: _OnlyTheProtocol(restored(*a), calls)
    try:
        toks, w1, w2 = _problem(world, "skewed")
        out_all, g_all, dy_all = _one_process(toks, w1, w2, "recompute")
        kw = dict(ep_config=_pairs("capacity", capacity=48) if dispatch == "capacity" else
                  _pairs(chunks=2) if dispatch == "exact_chunks2" else PAIRS)
        out, g, mine, experts = _ep(rank, world, toks, w1, w2, "recompute", dy_all, **kw)
    finally:
        ep_module.make_plan, ep_module.restore_plan = made, restored
    _assert_equal((out, g), (out_all, g_all), mine, experts)
    assert {"tensors", "send", "dispatch_groups", "dispatch", "return_buffer", "give_back_group", "combine",
            "in_send_order"} <= set(calls), calls


def _protocol_cases(rank, world, found, dispatches):
    for dispatch in dispatches:
        _through_the_protocol(rank, world, dispatch)


def test_the_op_bodies_use_the_transport_protocol_only():
    """Another transport plugs in without touching the op: wrapped so that only plan.Transport's members are
    reachable, both plans give expert parallelism's results bit for bit (forward and backward, recompute: rows
    sent again)."""
    run_ranks(_protocol_cases, 2, ("exact", "capacity", "exact_chunks2"))


def test_receiver_index_orders_rows_by_expert_then_source():
    counts = torch.tensor([[2, 0, 1], [0, 0, 3], [1, 0, 0]], dtype=torch.int32)  # (source, local expert)
    r = receiver_index(counts)
    # rows arrive: source 0: e0 e0 e2 | source 1: e2 e2 e2 | source 2: e0
    assert r.expert_counts.tolist() == [3, 0, 4] and r.expert_offsets.tolist() == [0, 3, 3, 7]
    assert r.expert_token_idx.tolist() == [0, 1, 6, 2, 3, 4, 5]
    assert torch.equal(r.expert_token_idx[r.token_slot[:, 0].long()], torch.arange(7, dtype=torch.int32))
    empty = receiver_index(torch.zeros(2, 3, dtype=torch.int32))
    assert empty.expert_token_idx.numel() == 0 and empty.expert_offsets.tolist() == [0, 0, 0, 0]


def _misuse(rank, world, errors):
    """Each misuse raises the same clear error on every rank, before any collective that could hang."""
    import pytest
    from torch.distributed.device_mesh import init_device_mesh

    from moeblaze.distributed import ExpertParallel
    from moeblaze.nn import Experts

    config = ExpertsConfig(backend="triton")
    mesh2d = init_device_mesh("cpu", (1, world))
    with pytest.raises(ValueError, match="must be 1-D"):
        ExpertParallel(Experts(16, 16, 2 * world, experts=config), mesh2d)
    mesh = init_device_mesh("cpu", (world,))
    what = "every rank of the expert-parallel group must pass the same "
    with pytest.raises(ValueError, match=what + r"number of experts; the ranks hold \[4, 6\]"):
        ExpertParallel(Experts(16, 16, 4 + 2 * rank, experts=config), mesh)
    # different arithmetic, said first
    with pytest.raises(ValueError, match=what + "ExpertsConfig; the ranks hold ExpertsConfigs that differ in "
                       r"checkpoint \('preact' on rank 0, 'recompute' on rank 1\)$"):
        ExpertParallel(Experts(16, 16, 4, experts=config.replace(checkpoint=("preact", "recompute")[rank])), mesh)
    with pytest.raises(ValueError, match=what + "EPConfig; the ranks hold EPConfigs that differ in dispatch "
                       r"\('exact' on rank 0, 'capacity' on rank 1\)"):  # different collectives
        ExpertParallel(Experts(16, 16, 4, experts=config), mesh,
                       ep_config=_pairs(("exact", "capacity")[rank]))
    with pytest.raises(TypeError, match="tracker must be a moeblaze CapacityTracker"):
        ExpertParallel(Experts(16, 16, 4, experts=config), mesh, ep_config=_pairs("capacity"), tracker=16)
    # 7 experts split 4 + 3: w1_local of different sizes
    E_loc = 4 - rank
    torch.manual_seed(rank)
    x, idx = torch.randn(5, 16), torch.stack([torch.randperm(6)[:2] for _ in range(5)]).int()
    with pytest.raises(ValueError, match="same number of local experts"):
        ep_experts(x, idx, torch.rand(5, 2), torch.randn(E_loc, 32, 16), torch.randn(E_loc, 16, 16), experts=config)
    # an absurd capacity: named, not an allocation failure deep inside
    w1, w2 = torch.randn(3, 32, 16), torch.randn(3, 16, 16)
    with pytest.raises(ValueError, match="more rows than a receiver's index can address"):
        ep_experts(x, idx, torch.rand(5, 2), w1, w2, experts=config,
                   ep_config=_pairs("capacity", capacity_factor=1e30))
    # more groups than local experts
    with pytest.raises(ValueError, match=r"chunks=4\) groups the local experts, and this rank holds 3"):
        ep_experts(x, idx, torch.rand(5, 2), w1, w2, experts=config, ep_config=_pairs(chunks=4))
    # the per-pair transport's expert groups under capacity dispatch (one group: its fixed shapes)
    with pytest.raises(ValueError, match=r"transport 'pairs' pipelines under dispatch 'exact' only, and dispatch is "
                       "'capacity'"):
        ep_experts(x, idx, torch.rand(5, 2), w1, w2, experts=config, ep_config=_pairs("capacity", chunks=2))


def _local_experts(rank, world, errors, split):
    import pytest

    from moeblaze.distributed.ep import _check_local_experts

    if not split:  # every rank 3: agreed, and remembered for this group
        _check_local_experts(3, None)
        return
    with pytest.raises(ValueError, match="same number of local experts"):  # 3 + 4 in the next group
        _check_local_experts(3 + rank, None)


def test_a_new_process_group_checks_the_local_experts_again():
    """A group name comes back with the next process group (these ranks' processes stay for the next call): a count
    agreed in the old group must not let one rank skip the check in the new one (it would hang the others)."""
    run_ranks(_local_experts, 2, False)
    run_ranks(_local_experts, 2, True, timeout_s=120)


def test_ep_misuse_is_one_clear_error_on_every_rank():
    run_ranks(_misuse, 2, timeout_s=300)
