"""Expert parallelism: the experts sharded over the ranks of a process group, each rank's tokens sent to the ranks
that hold their experts and back by all-to-all, the zero-buffer routing index on both sides (ep_experts). This module
is the entry: it checks a call once, sizes capacity dispatch's rows, and hands the call to the transport its
EPConfig names (distributed.transports: "pairs", one row per (token, expert) pair, bitwise equal to one GPU,
distributed.pairs; "tokens", one row per (token, rank), distributed.tokens). Each transport's header has its data
flow and memory contract.

Dispatch modes (every transport):
  exact     variable split sizes, read on the host once per layer call (one device-to-host sync; backward reuses
            them).
  capacity  C rows per (source, destination) pair, equal splits, fixed shapes (torch.compile, CUDA graphs). A
            destination's rows past C are overflow, never silent: on_overflow="error" raises CapacityOverflow on
            every rank before any row is sent; "drop" drops them (counted where `dropped` is given); a
            CapacityTracker records what each destination needed for the caller's rerun.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist

from ..configs import DEFAULT, EPConfig, ExpertsConfig, check_config, from_legacy
from ..experts import call_weights, kernel_op_key
from ..experts.dispatch import choose
from ..routing.checks import check_expert_inputs, check_topk_idx, check_topk_weights
from .plan import CapacityTracker
from .stops import Disagreed, refuse, signature
from .transports import EPCall, capacity_rows, transport


def check_options(config: ExpertsConfig) -> None:
    """ValueError or TypeError naming the option unless expert parallelism runs this recipe: the kernels, as one
    call on the received rows (the dispatch's own options are EPConfig's to check)."""
    if not isinstance(config, ExpertsConfig):
        raise TypeError(f"experts must be a moeblaze.ExpertsConfig, got {type(config).__name__}")
    if config.backend == "reference":
        raise ValueError("expert parallelism runs the kernels: backend='reference' is not available under it")
    if config.chunk_tokens is not None:
        raise ValueError(f"chunk_tokens={config.chunk_tokens} does not apply under expert parallelism (the received "
                         "rows run as one call): leave it None, or bound the rows with dispatch='capacity'")


# process group -> the call signatures its ranks were checked to agree on (by the group object: a name such as "0"
# comes back with the next group after destroy_process_group, and a signature agreed in the old one proves nothing)
_AGREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# process group -> its last agreed ep_experts call's (local experts, EPConfig, device): what a rank refusing its inputs
# in a later call shapes the transport's first exchange by (_refuse); a group here is past its first call
_LAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# what every rank of an expert-parallel group must pass alike, as the error names it
AGREED_FIELDS = {"experts": "number of local experts (w1_local.shape[0])",
                 "weights": "expert weights' shapes and dtype", "x": "width and dtype of x",
                 "top_k": "top-k (topk_idx.shape[1])", "recipe": "ExpertsConfig", "ep_config": "EPConfig",
                 "tracker": "CapacityTracker (given or not)", "inputs": "inputs' checks",
                 "num_experts": "number of experts", "shape": "d_model and d_expert",
                 "dispatch": "Megatron layer's dispatch (get_moeblaze_gpt_layer_spec's dispatch=)",
                 "mesh": "device mesh (shape and dimension names)", "mixed_precision": "MixedPrecisionPolicy",
                 "reshard_after_forward": "reshard_after_forward", "units": "FSDP2 units (parallelize's units=)",
                 "parameters": "model parameters (their names, shapes and dtypes)",
                 "entry": "entry point"}


def check_agreement(group, _again: bool = False, _of: str = "expert-parallel group", **fields) -> int:
    """ValueError on every rank of `group`, naming each field (AGREED_FIELDS) that differs and what each rank holds,
    unless every rank passes the same values: one collective per group and set of values (a set agreed once is
    remembered, so a training loop pays it once; _again: gather even so; _of: what the error calls the group). A
    rank whose inputs were refused passes its error as `inputs`, so that every rank raises it, not that rank alone
    while the others wait in the next collective. Returns the values' signature (stops.signature), which the
    transport's first exchange carries: ranks that each pass a set agreed before, but not the same one, stop there
    (stops.Disagreed)."""
    pg, key = group if group is not None else dist.group.WORLD, _key(fields)
    if key in _AGREED.get(pg, ()) and not _again:
        return signature(key)
    held = [None] * dist.get_world_size(group)
    dist.all_gather_object(held, fields, group=group)
    refusals = [f"rank {r}'s were refused ({h['inputs']})" for r, h in enumerate(held) if h.get("inputs", "ok") != "ok"]
    if refusals:
        raise ValueError(f"every rank of the {_of} stops: " + "; ".join(refusals))
    differ = []
    for name in fields:
        values = [h.get(name) for h in held]
        if len({repr(v) for v in values}) > 1:
            differ.append(f"the same {AGREED_FIELDS.get(name, name)}; the ranks hold {_differences(values)}")
    if differ:
        raise ValueError(f"every rank of the {_of} must pass " + "; and ".join(differ))
    _AGREED.setdefault(pg, set()).add(key)
    return signature(key)


def _key(fields: dict) -> tuple:
    """The values of an agreement as a hashable tuple (dataclasses by their repr)."""
    return tuple((name, repr(value) if dataclasses.is_dataclass(value) else value) for name, value in fields.items())


def _differences(values: list) -> str:
    """What the ranks hold: for configs of one dataclass, only the fields that differ, rank by rank."""
    kind = type(values[0])
    if not (dataclasses.is_dataclass(kind) and all(type(v) is kind for v in values)):
        return str(values)
    fields = [f.name for f in dataclasses.fields(kind)
              if len({repr(getattr(v, f.name)) for v in values}) > 1]
    return f"{kind.__name__}s that differ in " + "; ".join(
        f + " (" + ", ".join(f"{getattr(v, f)!r} on rank {r}" for r, v in enumerate(values)) + ")" for f in fields)


def _check_local_experts(E_loc: int, group) -> None:
    """The ranks of `group` hold the same number of local experts (check_agreement on that alone)."""
    check_agreement(group, experts=E_loc)


def ep_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
               w1_local: torch.Tensor | tuple[torch.Tensor, torch.Tensor], w2_local: torch.Tensor, *, group=None,
               experts: ExpertsConfig = DEFAULT,
               ep_config: EPConfig | None = None, tracker: CapacityTracker | None = None,
               dropped: torch.Tensor | None = None, config: ExpertsConfig | None = None) -> torch.Tensor:
    """The experts' combined output (L, D) for this rank's tokens x (L, D), routed to global expert ids topk_idx
    (L, K) with weights (L, K), over the experts sharded across `group` (default: the world): this rank holds
    experts [rank · E_loc, (rank + 1) · E_loc) as w1_local (E_loc, F, D) (or its gate and up rows apart, as for
    moe_experts: read in place, no copy kept) and w2_local (E_loc, D, H). Every rank of
    the group must call it (a rank without tokens passes L = 0). Differentiable in x, topk_weights and the local
    weights. experts: the recipe, as for moe_experts (every precision and checkpoint policy; chunk_tokens is refused:
    the received rows run as one call, and dispatch="capacity" bounds them; fp8_min_rows is judged on L·ep tokens,
    this rank's L as every rank's); the kernels run the experts (a GPU,
    or the interpreter on the CPU): backend "auto" is "triton" here, and "reference" is refused. Every rank must
    hold the same number of local experts (checked once per group and count, one collective).

    ep_config: the dispatch (moeblaze.EPConfig; None: exact).
    dispatch="capacity": C rows per (source, destination) pair, the same on every rank: `capacity`, or
    tracker.capacity, or ⌈capacity_factor · L · K / ep⌉ rounded up to 16 (then every rank must have the same L:
    the ranks check that they agree on C with the counts they exchange, and a disagreement is an error on every
    rank before any row is sent: a ValueError under on_overflow="error", and on CPU processes; with "drop" or a
    tracker, which never sync, a device-side assert on GPUs).
    Overflow (a destination needing more than C rows): with a tracker, recorded for the caller's rerun (and
    dropped in this call); otherwise on_overflow "error" (default: CapacityOverflow on every rank before any row
    is sent, one host read of an all-reduced flag; refused under CUDA-graph capture) or "drop". dropped: a
    device counter (an int64 scalar) that the number of rows this rank drops is added to (no host sync), under
    on_overflow="drop".

    Args:
        x: (L, D) this rank's tokens, float.
        topk_idx, topk_weights: (L, K) global expert ids (int) and their weights (float).
        w1_local, w2_local: (E_loc, F, D) (or the pair (gate rows, up rows)) and (E_loc, D, H), this rank's experts.
        group: the expert-parallel process group (None: the world).
        experts: the experts' moeblaze.ExpertsConfig.
        ep_config: the dispatch, a moeblaze.EPConfig (None: exact).
        tracker: a CapacityTracker sizing capacity dispatch, or None.
        dropped: an int64 scalar tensor counting the rows this rank drops (on_overflow="drop"), or None.
        config: 0.2's name for `experts` (a DeprecationWarning).

    Returns:
        (L, D) in x's dtype: this rank's tokens' combined expert outputs.
    """
    ep = dist.get_world_size(group)
    config, ep_config, t = _checked(x, topk_idx, topk_weights, w1_local, w2_local, group, experts, config, ep_config,
                                    tracker)
    w1_local, w1_up = (w1_local, None) if isinstance(w1_local, torch.Tensor) else w1_local
    E_loc = w1_local.shape[0]
    agreement = dict(entry="ep_experts", experts=E_loc,
                     weights=(tuple(w1_local.shape[1:]), tuple(w2_local.shape[1:]), str(w1_local.dtype),
                              w1_up is not None),
                     x=(x.shape[1], str(x.dtype)), top_k=topk_idx.shape[1], recipe=config, ep_config=ep_config,
                     tracker=tracker is not None, inputs="ok")
    pg = group if group is not None else dist.group.WORLD
    if torch.compiler.is_compiling():  # agreed in eager mode: a trace runs what the eager calls ran
        agreed = 0
    else:  # past the group's first call, the values ride on the transport's first exchange as their signature
        agreed = (signature(_key(agreement)) if _past_first_call(pg) and t.first_exchange is not None
                  else check_agreement(group, **agreement))
        _LAST[pg] = (E_loc, ep_config, x.device)
    E = E_loc * ep
    L, K = topk_idx.shape
    C = _capacity(t, ep_config, tracker, L, K, ep, E_loc)
    backend = choose("triton" if config.backend == "auto" else config.backend, x.device)
    # the receiver's index has dropped pairs (capacity's padding; every "tokens" row's pairs held elsewhere);
    # fp8_min_rows judged as if every rank had this rank's L
    call = (L * ep, K, E)
    key = kernel_op_key(x, config, backend, C is not None or t.sentinels, False, call=call)
    w1_local, w1_up, w2_local = call_weights(config.at_call(*call).fp8, x, w1_local, w1_up, w2_local)
    fail = ep_config.overflow == "error" and tracker is None  # an overflow an error on every rank: a host read
    _check_chunks(t, ep_config, E_loc)
    try:
        out, needed = t.run(EPCall(x, topk_idx, topk_weights, w1_local, w2_local, w1_up, _group_name(group), key, C,
                                   fail, ep_config.chunks, config.index_method, E, ep_config.wire, agreed))
    except Disagreed:  # every rank is here (a signature differed): gather the values once more, to name them
        check_agreement(group, _again=True, **agreement)
        raise
    if tracker is not None:
        tracker.record(needed)
    if dropped is not None and C is not None and ep_config.overflow == "drop" and tracker is None:
        dropped.add_((t.rows_per_dest(topk_idx, E_loc, ep) - C).clamp(min=0).sum())
    return out


def _checked(x, topk_idx, topk_weights, w1_local, w2_local, group, experts, config, ep_config, tracker):
    """(config, ep_config, the transport) of an ep_experts call, after every check that reads this rank's
    arguments; a refusal raises on every rank (the group's first call agrees on the verdict; a later one makes the
    transport's first exchange with it set)."""
    ep = dist.get_world_size(group)
    try:
        config = from_legacy("ep_experts", experts, {"config": config}, stacklevel=4)  # (from ep_experts' _checked)
        check_options(config)
        ep_config, t = check_ep(ep_config, tracker)
        check_expert_inputs(x, w1_local, w2_local, config.activation, masters=config.fp8)
        check_topk_idx(topk_idx, (w1_local if isinstance(w1_local, torch.Tensor) else w1_local[0]).shape[0] * ep)
        check_topk_weights(topk_weights, topk_idx)
    except (TypeError, ValueError) as e:
        pg = group if group is not None else dist.group.WORLD
        if _past_first_call(pg):
            # the others, past a first ep_experts call in this group, make no agreement collective here: this rank
            # makes their transport's first exchange, as the group's last call made it, with its verdict set, so
            # that they stop there with it (stops.REFUSED). Another entry's agreement in the group (ExpertParallel's,
            # a Megatron layer's, when built) doesn't count: the others' first ep_experts call makes the one below
            _refuse(group, pg, ep)
            raise
        # every rank's first call makes this one: all raise
        check_agreement(group, entry="ep_experts", inputs=f"{type(e).__name__}: {e}")
    return config, ep_config, t


def check_ep(ep_config: EPConfig | None, tracker: CapacityTracker | None):
    """(the EPConfig, None made the default; its transport) after the checks between them and a tracker: a
    transport registered under the name, a wire it sends, a tracker only for capacity dispatch. TypeError or
    ValueError naming the field."""
    ep_config = check_config("ep_config", ep_config, EPConfig) or EPConfig()
    t = transport(ep_config.transport)
    if ep_config.wire not in t.wires:
        raise ValueError(f"EPConfig(wire={ep_config.wire!r}): transport {ep_config.transport!r} sends rows in "
                         f"{' or '.join(map(repr, t.wires))} only")
    if tracker is not None and not isinstance(tracker, CapacityTracker):
        raise TypeError(f"tracker must be a moeblaze CapacityTracker or None, got {type(tracker).__name__}")
    if tracker is not None and ep_config.dispatch != "capacity":
        raise ValueError("a CapacityTracker sizes capacity dispatch: it needs ep_config=EPConfig(dispatch='capacity')")
    return ep_config, t


def _capacity(t, ep_config: EPConfig, tracker, L: int, K: int, ep: int, E_loc: int) -> int | None:
    """Capacity dispatch's rows per (source, destination) pair (None: exact dispatch): the EPConfig's, the
    tracker's, or from capacity_factor and the transport's mean rows."""
    if ep_config.dispatch != "capacity":
        return None
    C = ep_config.capacity if ep_config.capacity is not None else tracker.capacity if tracker is not None else None
    if C is None:
        C = capacity_rows(t, ep_config.factor, L, K, ep, E_loc)
    if C * ep * t.pairs_per_row(K) >= 2 ** 31:  # the receiver's index addresses its pairs with int32
        raise ValueError(f"capacity dispatch: {C} rows per pair over {ep} ranks is more rows than a receiver's "
                         "index can address (2^31); every rank sends at most its L·K pairs: lower capacity or "
                         "capacity_factor")
    return C


def _check_chunks(t, ep_config: EPConfig, E_loc: int) -> None:
    """EPConfig.chunks where the transport pipelines under this dispatch, and no more expert groups than experts."""
    if ep_config.chunks > 1 and ep_config.dispatch not in t.chunks:
        raise ValueError(f"EPConfig(chunks={ep_config.chunks}): transport {ep_config.transport!r} pipelines "
                         + (f"under dispatch {' or '.join(map(repr, t.chunks))} only" if t.chunks else "nothing")
                         + f", and dispatch is {ep_config.dispatch!r}: leave chunks at 1")
    if ep_config.chunks > E_loc and t.expert_chunks:
        raise ValueError(f"EPConfig(chunks={ep_config.chunks}) groups the local experts, and this rank holds "
                         f"{E_loc}: chunks must be at most that")


def _past_first_call(pg) -> bool:
    """Whether an ep_experts call in process group pg agreed (one collective) already: every rank of the group is
    past its first call alike (another entry's agreement in the group, ExpertParallel's or a Megatron layer's when
    built, doesn't count)."""
    return pg in _LAST


def _refuse(group, pg, ep: int) -> None:
    """This rank's side of the transport's first exchange with its verdict set, shaped as the group's last agreed
    call's (its local experts and dispatch): where the other ranks make the same call again, they stop there too.
    Nothing where the transport declares no first exchange (this rank then raises alone)."""
    last = _LAST.get(pg)
    if last is None:
        return
    E_loc, ep_config, device = last
    shape = transport(ep_config.transport).first_exchange
    if shape is not None:
        refuse(group, shape(ep, E_loc, None if ep_config.dispatch == "exact" else 1), device)


def _group_name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name
