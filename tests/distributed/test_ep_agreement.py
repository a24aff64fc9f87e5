"""One world: under expert parallelism a group's first call that differs between ranks (the recipe, the EPConfig, a
tracker on one rank only) or whose inputs one rank refuses (an expert id out of range or repeated, x of the wrong
width or dtype, weights of the wrong shape) is the same one-line error on every rank, at 2 and 4 gloo ranks, never
a hang or an abort; and every rank, having caught it, runs the next call with agreeing inputs to one process's
result."""

import pytest
import torch

from moeblaze import EPConfig, ExpertsConfig
from moeblaze.distributed import CapacityTracker, ep_experts
from moeblaze.experts import moe_experts
from moeblaze.routing import build_routing_index

from helpers import assert_within_torch_error, random_problem, run_ranks

BASE = ExpertsConfig(backend="triton")


def _problem(world):
    torch.manual_seed(3)
    E, D, H, K = 2 * world, 16, 16, 2
    toks = [random_problem(6 + r, D, H, E, K) for r in range(world)]
    _, w1, w2, _, _ = random_problem(1, D, H, E, K)
    return [(t[0], t[3].int(), t[4]) for t in toks], w1, w2


def _mismatch(rank, world, case):
    """This rank's arguments for `case`: every rank's agree but one's (the last rank's)."""
    toks, w1, w2 = _problem(world)
    x, idx, w = toks[rank]
    E_loc = w1.shape[0] // world
    odd = rank == world - 1
    kw = dict(experts=BASE, ep_config=EPConfig())
    if case == "checkpoint":
        kw["experts"] = BASE.replace(checkpoint="recompute" if odd else "preact")
    elif case == "precision":
        kw["experts"] = BASE.replace(precision="fp8", fp8_min_rows=0) if odd else BASE
    elif case == "fp8_min_rows":
        kw["experts"] = BASE.replace(precision="fp8", fp8_min_rows=1 if odd else 2048)
    elif case == "dispatch":
        kw["ep_config"] = EPConfig("capacity" if odd else "exact")
    elif case == "transport":
        kw["ep_config"] = EPConfig(transport="pairs" if odd else "tokens")
    elif case == "chunks":
        kw["ep_config"] = EPConfig(transport="pairs", chunks=2 if odd else 1)
    elif case == "on_overflow":
        kw["ep_config"] = EPConfig("capacity", capacity=4, on_overflow="drop" if odd else "error")
    elif case == "tracker":
        kw["ep_config"] = EPConfig("capacity")
        kw["tracker"] = CapacityTracker(16) if odd else None
    elif case == "id_out_of_range" and odd:
        idx = idx.clone()
        idx[0, 0] = 99
    elif case == "id_repeated" and odd:
        idx = idx.clone()
        idx[0, 1] = idx[0, 0]
    elif case == "x_width" and odd:
        x = torch.randn(x.shape[0], x.shape[1] + 1)
    elif case == "x_dtype" and odd:
        x = x.double()
    elif case == "weights_shape" and odd:
        w2 = torch.randn(w2.shape[0], w2.shape[1], w2.shape[2] + 2)
    return x, idx, w, w1[rank * E_loc:(rank + 1) * E_loc], w2[rank * E_loc:(rank + 1) * E_loc], kw


def _one_process(world, dtype):
    """Every rank's tokens through all experts in one process, torch's reference at `dtype`."""
    toks, w1, w2 = _problem(world)
    x, idx, w = (torch.cat([t[i] for t in toks]) for i in range(3))
    x, w, w1, w2 = (t.to(dtype) for t in (x, w, w1, w2))
    return moe_experts(x, build_routing_index(idx, w1.shape[0]), w, w1, w2, experts=ExpertsConfig(backend="reference"))


def _cases(rank, world, errors, cases):
    import torch.distributed as dist

    for case in cases:
        try:
            x, idx, w, w1, w2, kw = _mismatch(rank, world, case)
            with pytest.raises(ValueError) as caught:
                ep_experts(x, idx, w, w1, w2, **kw)
            message = str(caught.value)
            assert "\n" not in message, message
            assert message.startswith("every rank of the expert-parallel group"), message
            said = [None] * world  # the same words on every rank
            dist.all_gather_object(said, message)
            assert len(set(said)) == 1, said
            # every rank caught it: the next call, agreeing, is one process's
            toks, w1_all, w2_all = _problem(world)
            E_loc = w1_all.shape[0] // world
            x, idx, w = toks[rank]
            out = ep_experts(x, idx, w, w1_all[rank * E_loc:(rank + 1) * E_loc],
                             w2_all[rank * E_loc:(rank + 1) * E_loc], experts=BASE)
            lo = sum(len(t[0]) for t in toks[:rank])
            mine = slice(lo, lo + len(x))
            assert_within_torch_error(out, _one_process(world, torch.float32)[mine],
                                      _one_process(world, torch.float64)[mine])
        except AssertionError as e:
            errors.put(f"rank {rank}, {case}: {e}")


RECIPES = ["checkpoint", "precision", "fp8_min_rows", "dispatch", "transport", "chunks", "on_overflow", "tracker"]
INPUTS = ["id_out_of_range", "id_repeated", "x_width", "x_dtype", "weights_shape"]


def _each(world, cases):
    for case in cases:  # a fresh process group each: nothing agreed before the mismatch
        run_ranks(_cases, world, [case], timeout_s=300)


def test_a_recipe_that_differs_between_ranks_is_one_error_on_every_rank():
    _each(2, RECIPES)
    _each(4, ["tracker"])


def test_inputs_one_rank_refuses_are_an_error_on_every_rank():
    _each(2, INPUTS)
    _each(4, ["id_out_of_range"])


def _refused_after_construction(rank, world, errors):
    """ExpertParallel agrees when built (one collective in its group); a first forward whose inputs one rank refuses
    is still that rank's error on every rank, not a rank raising alone while the others wait."""
    from torch.distributed.device_mesh import init_device_mesh

    from moeblaze.distributed import ExpertParallel
    from moeblaze.nn import Experts

    toks, w1, w2 = _problem(world)
    x, idx, w = toks[rank]
    mesh = init_device_mesh("cpu", (world,))
    layer = ExpertParallel(Experts(x.shape[1], w2.shape[2], w1.shape[0], experts=BASE), mesh)
    if rank == world - 1:
        x = torch.randn(x.shape[0], x.shape[1] + 1)
    try:
        layer(x, idx, w)
    except ValueError as e:
        if not str(e).startswith("every rank of the expert-parallel group stops"):
            errors.put(f"rank {rank}: {e}")
    else:
        errors.put(f"rank {rank}: nothing raised")


def test_inputs_refused_after_the_layer_agreed_when_built_are_an_error_on_every_rank():
    for world in (2, 4):
        run_ranks(_refused_after_construction, world, timeout_s=300)


def _refused_later(rank, world, errors, ep_config):
    """After the group has agreed (a first call that ran), a call whose inputs one rank refuses: that rank makes the
    transport's first exchange with its verdict set, so every rank stops there (the refused rank with its own error,
    the others with the transport's), and the next agreeing call runs."""
    from moeblaze.distributed.stops import REFUSED

    toks, w1, w2 = _problem(world)
    E_loc = w1.shape[0] // world
    x, idx, w = toks[rank]
    mine = w1[rank * E_loc:(rank + 1) * E_loc], w2[rank * E_loc:(rank + 1) * E_loc]
    ep_experts(x, idx, w, *mine, experts=BASE, ep_config=ep_config)  # agreed
    bad = torch.randn(x.shape[0], x.shape[1] + 1) if rank == world - 1 else x
    try:
        ep_experts(bad, idx, w, *mine, experts=BASE, ep_config=ep_config)
    except ValueError as e:
        want = "hidden size mismatch" if rank == world - 1 else REFUSED
        if want not in str(e):
            errors.put(f"rank {rank}, {ep_config}: {e}")
    else:
        errors.put(f"rank {rank}, {ep_config}: nothing raised")
    out = ep_experts(x, idx, w, *mine, experts=BASE, ep_config=ep_config)  # the group goes on
    lo = sum(len(t[0]) for t in toks[:rank])
    assert_within_torch_error(out, _one_process(world, torch.float32)[lo:lo + len(x)],
                              _one_process(world, torch.float64)[lo:lo + len(x)])


@pytest.mark.parametrize("ep_config", [EPConfig(), EPConfig("capacity", capacity=32),
                                       EPConfig("capacity", capacity=32, on_overflow="drop"),
                                       EPConfig(transport="pairs"),
                                       EPConfig("capacity", capacity=32, transport="pairs")],
                         ids=["tokens-exact", "tokens-capacity", "tokens-drop", "pairs-exact", "pairs-capacity"])
def test_inputs_refused_after_the_group_agreed_stop_every_rank(ep_config):
    run_ranks(_refused_later, 2, ep_config, timeout_s=300)
    if ep_config.transport == "tokens" and ep_config.dispatch == "exact":
        run_ranks(_refused_later, 4, ep_config, timeout_s=300)


def _sets_agreed_then_mixed(rank, world, errors, ep_config, case):
    """After the group's first call, a call's values ride on the transport's first exchange as their signature. Ranks
    that agreed on float32 calls and on float16 ones and then pass one each ("both_agreed": each rank's own set was
    agreed before), or that agreed on float32 calls when one passes float16 ("one_new"): every rank stops at that
    exchange with one error naming the dtypes that differ, never an abort, and runs the next agreeing call."""
    import torch.distributed as dist

    toks, w1, w2 = _problem(world)
    E_loc = w1.shape[0] // world
    x, idx, w = toks[rank]
    mine = w1[rank * E_loc:(rank + 1) * E_loc], w2[rank * E_loc:(rank + 1) * E_loc]

    def call(dtype):
        return ep_experts(x.to(dtype), idx, w.to(dtype), *(t.to(dtype) for t in mine), experts=BASE,
                          ep_config=ep_config)

    for dtype in (torch.float32, torch.float16) if case == "both_agreed" else (torch.float32,):
        call(dtype)
    try:
        call(torch.float16 if rank == world - 1 else torch.float32)
    except ValueError as e:
        said = [None] * world
        dist.all_gather_object(said, str(e))
        want = ("every rank of the expert-parallel group must pass the same expert weights' shapes and dtype",
                "; and the same width and dtype of x; the ranks hold [" + ", ".join(
                    f"(16, 'torch.float{16 if r == world - 1 else 32}')" for r in range(world)) + "]")
        if not (str(e).startswith(want[0]) and str(e).endswith(want[1]) and len(set(said)) == 1):
            errors.put(f"rank {rank}, {case}, {ep_config}: {said}")
    else:
        errors.put(f"rank {rank}, {case}, {ep_config}: nothing raised")
    lo = sum(len(t[0]) for t in toks[:rank])
    assert_within_torch_error(call(torch.float32), _one_process(world, torch.float32)[lo:lo + len(x)],
                              _one_process(world, torch.float64)[lo:lo + len(x)])


@pytest.mark.parametrize("ep_config", [EPConfig(), EPConfig("capacity", capacity=32, on_overflow="drop"),
                                       EPConfig(transport="pairs"), EPConfig("capacity", capacity=32,
                                                                             transport="pairs")],
                         ids=["tokens-exact", "tokens-drop", "pairs-exact", "pairs-capacity"])
def test_values_that_differ_after_the_first_call_stop_every_rank(ep_config):
    for case in ("both_agreed", "one_new"):
        run_ranks(_sets_agreed_then_mixed, 2, ep_config, case, timeout_s=300)
    if ep_config.transport == "tokens" and ep_config.dispatch == "exact":
        run_ranks(_sets_agreed_then_mixed, 4, ep_config, "both_agreed", timeout_s=300)


def test_every_device_side_assert_message_fits_cudas_limit():
    """CUDA refuses a device-side assert whose message is over 254 bytes, at the call ("Message length must be
    smaller than 255"): capacity dispatch under on_overflow="drop" on a GPU stopped at every call so, with the stops'
    message (270 bytes). Every message that can become one is held to the limit on the CPU too."""
    from moeblaze.distributed.stops import assert_none
    from moeblaze.routing.checks import fail_if

    with pytest.raises(RuntimeError, match="over 254 bytes"):
        fail_if(torch.tensor(False), "x" * 255)
    fail_if(torch.tensor(False), "\u00e9" * 127)  # 254 bytes
    assert_none(torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="expert-parallel group stops"):
        assert_none(torch.tensor([0, 2]))
