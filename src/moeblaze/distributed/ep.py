"""Expert parallelism: the experts sharded over the ranks of a process group, tokens sent to them and back by
all-to-all, with the zero-buffer routing index on both sides.

Sender (every rank, its own L tokens): the routing index over all E experts (global id = rank · E_loc + local
id) is already in send order, expert by expert, so rank d's rows are the contiguous block of its E_loc experts;
the send buffer is x[expert_token_idx] (the one copy an all-to-all needs). The (ep, E_loc) counts go first (one
fixed-size all-to-all), then the rows.
Receiver: the rows arrive grouped by source rank, then local expert, then token. receiver_index builds, from the
count matrix alone, a routing index over the E_loc local experts with K = 1 whose expert-major order is (expert,
source rank, token): the global token order, so each expert reduces its rows as on one GPU. The fused kernels
gather the received rows through it: no permuted copy. The expert side runs with unit weights, so its output rows
are Y itself; they go back, and the sender combines them with its router weights through token_slot, as on one
GPU (bitwise the same where the kernels' configs are the same).
Backward mirrors it: dy[expert_token_idx] and the router weights in row order go to the experts, which return
dX~ and dS = <dA', A> per row; dx and the router-weight gradient are then the sender's combine and a gather.

Dispatch modes:
  exact     variable split sizes, read on the host once per layer call (one device-to-host sync; backward reuses
            them); R = the rows actually routed here.
  capacity  C rows per (source, destination) pair, equal splits: no host sync. A destination's rows past C (in its
            expert order) are overflow: never silent. on_overflow="error" stops the program (a device-side assert
            on GPUs), "drop" drops them (they add nothing, as transformers' sentinels), and a CapacityTracker
            records the rows each destination needed so that the caller can grow C and rerun the step. The
            receiver's padding rows are dropped pairs of its index (routing.index's sentinels): never computed.
            R = ep·C.
Memory kept per layer, beyond the routing indexes (O(L·K + R) int32) and the tile schedule: under
checkpoint="preact" the received rows R·D and the pre-activation R·F; under "recompute" nothing more: the rows are
sent again in backward and the pre-activation recomputed. Transient: the send and return buffers (L·K·D each in
exact mode, ep·C·D in capacity mode).

Legend: ep ranks, E experts (E_loc = E / ep per rank), L tokens and K experts per token on this rank, R rows
received, D hidden, F rows of W1 per expert.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..experts import kernel_op_key
from ..experts.dispatch import choose
from ..experts.op import Kept, OpInputs, experts_backward, experts_forward, kept_like, parse
from ..experts.schedule import BLOCK_M
from ..experts.stages import combine_slots
from ..launch import ensure_context
from ..configs import DEFAULT, EPConfig, ExpertsConfig, ep_from_legacy, from_legacy
from ..reference.fp8 import FP8
from ..routing import RoutingIndex, build_routing_index
from ..routing.checks import check_expert_inputs, check_topk_weights
from ..routing.index import in_row_order, pair_experts


def receiver_index(counts_SE: torch.Tensor) -> RoutingIndex:
    """The K = 1 routing index of rows received grouped by source rank, then local expert (counts_SE (ep, E_loc):
    rows from source s for local expert e), over the E_loc local experts: expert-major, then source, then
    arrival order. One pass of O(R) index arithmetic, no sort; R is read on the host (repeat_interleave's size)."""
    S, E = counts_SE.shape
    c = counts_SE.to(torch.int64)
    start_SE = (c.flatten().cumsum(0) - c.flatten()).view(S, E)  # first received row of each (source, expert)
    size_ES = c.t().flatten()  # the same blocks in expert-major order
    R = int(size_ES.sum())
    block = torch.repeat_interleave(torch.arange(S * E, device=c.device), size_ES, output_size=R)
    first = size_ES.cumsum(0) - size_ES  # each block's first position in expert-major order
    rows = start_SE.t().flatten()[block] + torch.arange(R, device=c.device) - first[block]
    slot = torch.empty(R, dtype=torch.int32, device=c.device)
    slot[rows] = torch.arange(R, dtype=torch.int32, device=c.device)
    counts_E = c.sum(0)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=c.device)
    offsets[1:] = counts_E.cumsum(0)
    return RoutingIndex(counts_E.int(), offsets, rows.int(), slot.view(R, 1))


def _all_to_all(t: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group) -> torch.Tensor:
    """t's rows split by in_splits (equal splits where None) to the ranks of group; the rows received."""
    rows = sum(out_splits) if out_splits is not None else t.shape[0]
    out = t.new_empty((rows,) + tuple(t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
    return out


class CapacityTracker:
    """The capacity of capacity-mode dispatch and what the layer calls needed: pass one tracker to every layer's
    ep_experts call of a step, then, after the step, `overflowed()` (one all-reduce and one host read for the
    whole step) says whether any destination needed more rows than `capacity`; `grow()` sets the capacity to
    what was needed (rounded up to `multiple`) for the rerun.

    Args:
        capacity: the first capacity, rows per (source, destination) pair.
        group: the process group the overflow check reduces over (None: the world).
        multiple: grow() rounds the capacity up to a multiple of it.
    """

    def __init__(self, capacity: int, group=None, multiple: int = 16):
        if capacity < 1:
            raise ValueError(f"capacity must be a positive number of rows, got {capacity}")
        self.capacity, self.group, self.multiple = capacity, group, multiple
        self.needed: torch.Tensor | None = None

    def record(self, needed: torch.Tensor) -> None:
        self.needed = needed if self.needed is None else torch.maximum(self.needed, needed)

    def overflowed(self) -> bool:
        if self.needed is None:
            return False
        need = self.needed.clone()
        dist.all_reduce(need, op=dist.ReduceOp.MAX, group=self.group)
        self.needed = need
        return int(need) > self.capacity

    def grow(self) -> int:
        need = int(self.needed) if self.needed is not None else self.capacity
        self.capacity = max(self.capacity, -(-need // self.multiple) * self.multiple)
        self.needed = None
        return self.capacity


class _Plan:
    """One EP layer call's routing on both sides. send_pos: the positions, in the sender's expert order, of the
    rows it sends (one per send-buffer row; padding repeats a valid one); slot_LK and kept: where each pair's
    returned row lands in the return buffer (slots >= kept: dropped); recv: the receiver's index; needed (capacity
    mode): the most rows any destination needed from this rank."""

    def __init__(self, routing: RoutingIndex, ep: int, group, capacity: int | None, fail_on_overflow: bool):
        self.routing, self.group = routing, group
        E = routing.num_experts
        E_loc, P, dev = E // ep, routing.expert_token_idx.shape[0], routing.token_slot.device
        send_counts = routing.expert_counts.view(ep, E_loc)
        if capacity is None:  # exact
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
            both = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).cpu()  # the one host sync
            self.in_splits, self.out_splits = both[0].tolist(), both[1].tolist()
            self.recv = receiver_index(recv_counts)
            self.send_pos = self.needed = None  # every row, in expert order
            self.slot_LK, self.kept = routing.token_slot, routing.expert_offsets[-1:]
            return
        per_dest = send_counts.sum(1)  # (ep,) rows for each destination
        # rows past C in a destination's expert order are dropped: clip the per-expert counts there
        cum = send_counts.cumsum(1).clamp(max=capacity)
        kept_counts = torch.diff(cum, dim=1, prepend=torch.zeros_like(cum[:, :1]))
        # each destination gets this rank's capacity with its counts: the row all-to-all's equal splits need the
        # same C on every rank, which a capacity sized from each rank's own token count breaks on uneven batches
        sent = torch.cat([kept_counts, kept_counts.new_full((ep, 1), capacity)], 1)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=group)
        _fail_if_any((got[:, E_loc] != capacity).any(), group, "capacity dispatch: the ranks use different "
                     f"capacities (this rank {capacity} rows per pair): with different token counts per rank, pass "
                     "the same capacity= on every rank or a CapacityTracker instead of sizing it by capacity_factor",
                     ValueError)
        recv_counts = got[:, :E_loc]
        self.needed = per_dest.max() if P else per_dest.new_zeros(())
        if fail_on_overflow:
            _fail_if_any(self.needed > capacity, group, f"capacity dispatch: a destination needs more than {capacity} "
                         "rows (raise the capacity factor, pass on_overflow='drop', or use a CapacityTracker)")
        self.in_splits = self.out_splits = None
        first = routing.expert_offsets[:-1].view(ep, E_loc)[:, 0].to(torch.int64)  # each destination's first row
        j = torch.arange(capacity, device=dev)
        self.send_pos = (first[:, None] + j).clamp(max=max(P - 1, 0)).flatten()
        # the receiver's rows: source s's block of C, its first rows by local expert, then padding (id E_loc)
        ids = torch.searchsorted(recv_counts.cumsum(1).to(torch.int64).contiguous(), j.expand(ep, -1).contiguous(),
                                 right=True)
        self.recv = build_routing_index(ids.reshape(-1, 1).int(), E_loc, check=False, sentinels=True)
        # each pair's row in the return buffer: destination d's block, at its position past d's first row
        dest = pair_experts(routing.expert_offsets, routing.token_slot).long() // E_loc
        pos = routing.token_slot.long() - first[dest]
        self.kept = torch.full((1,), ep * capacity, dtype=torch.int32, device=dev)
        self.slot_LK = torch.where(pos < capacity, dest * capacity + pos, ep * capacity).int()

    def saved(self) -> tuple:
        """A capacity plan's tensors (what restore takes back)."""
        return (*self.recv.tensors(), self.send_pos, self.slot_LK, self.kept)

    @classmethod
    def restore(cls, routing: RoutingIndex, group, saved) -> _Plan:
        """The capacity plan whose tensors are `saved`, without any communication."""
        plan = cls.__new__(cls)
        counts, offsets, eti, slot, plan.send_pos, plan.slot_LK, plan.kept = saved
        plan.routing, plan.group, plan.in_splits, plan.out_splits, plan.needed = routing, group, None, None, None
        plan.recv = RoutingIndex(counts, offsets, eti, slot, dropped=True)
        return plan

    def in_send_order(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (in the sender's expert order) as the send buffer lays them out (zeros where there are none)."""
        if self.send_pos is None:
            return rows
        if rows.shape[0] == 0:
            return rows.new_zeros((self.send_pos.shape[0],) + tuple(rows.shape[1:]))
        return rows[self.send_pos]

    def send(self, rows_LD: torch.Tensor) -> torch.Tensor:
        """The send buffer of rows_LD (x or dy): its rows in send order, gathered through the routing index."""
        if rows_LD.shape[0] == 0:  # no tokens here
            return self.in_send_order(rows_LD)
        return rows_LD[self.in_send_order(self.routing.expert_token_idx).long()]

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        return _all_to_all(rows, self.out_splits, self.in_splits, self.group)

    def give_back(self, rows: torch.Tensor) -> torch.Tensor:
        return _all_to_all(rows, self.in_splits, self.out_splits, self.group)

    def combine(self, rows: torch.Tensor, weights_LK, out_dtype) -> torch.Tensor:
        """The sender's combine of returned rows: sum_k (w[t, k] ·) rows[slot[t, k]], dropped slots adding 0."""
        return combine_slots(rows, self.slot_LK, weights_LK, self.kept, out_dtype)


def _fail_if_any(bad: torch.Tensor, group, message: str, error: type = RuntimeError) -> None:
    """A device-side assert on GPUs (no host sync; the program stops, and the other ranks with it). On the CPU,
    where a host read is free, every rank raises `error` together (one all-reduce), so none is left waiting in the
    next collective."""
    if bad.device.type != "cpu":
        torch._assert_async(~bad, message)
        return
    flag = bad.to(torch.int32).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag):
        raise error(message)


def _forward(x, topk_w, w1, w2, plan: _Plan, key: str):
    """(out, what backward needs: the received rows (empty under recompute), preact as kept, its scales, *the tile
    schedule)."""
    r = plan.recv
    recv_x = plan.dispatch(plan.send(x))
    ones = recv_x.new_ones(recv_x.shape[0], 1, dtype=torch.float32)
    y, (kept, scale, *sched) = experts_forward(OpInputs.of(recv_x, w1, w2, ones, r), key)
    ret = plan.give_back(y)
    del y
    out = plan.combine(ret, topk_w.float().contiguous(), x.dtype) if x.shape[0] else torch.zeros_like(x)
    return out, (recv_x if _keeps_rows(key) else x.new_empty(0)), kept, scale, *sched


def _keeps_rows(key: str) -> bool:
    """Whether the received rows are kept for backward (else sent again): unless the recipe recomputes."""
    return parse(key).checkpoint != "recompute"


def _backward(dout, x, topk_w, w1, w2, plan: _Plan, recv_x, kept, scale, sched, key: str):
    """(dx, dtopk_w, dw1, dw2)."""
    r = plan.recv
    if not _keeps_rows(key):  # "recompute": the rows are sent again
        recv_x = plan.dispatch(plan.send(x))
    dy_recv = plan.dispatch(plan.send(dout.contiguous()))
    w_rows = in_row_order(topk_w, plan.routing.token_slot, plan.routing.expert_token_idx.shape[0],
                          torch.float32)  # router weights in expert order
    w_recv = plan.dispatch(plan.in_send_order(w_rows)).view(-1, 1)
    dx_recv, dw1, dw2, ds_recv, *_ = experts_backward(dy_recv, OpInputs.of(recv_x, w1, w2, w_recv, r),
                                                      Kept(kept, scale, *sched), key)
    del dy_recv, recv_x
    dx_ret = plan.give_back(dx_recv)
    ds_ret = plan.give_back(ds_recv.view(-1))
    dx = plan.combine(dx_ret, None, x.dtype) if x.shape[0] else torch.zeros_like(x)
    slot = plan.slot_LK.long()
    dtopk_w = (ds_ret[slot.clamp(max=max(ds_ret.shape[0] - 1, 0))] if ds_ret.numel() else
               ds_ret.new_zeros(slot.shape))
    dtopk_w = dtopk_w.masked_fill(slot >= plan.kept, 0).to(topk_w.dtype)
    return dx, dtopk_w, dw1, dw2


class _EPExperts(torch.autograd.Function):
    """Eager mode, both dispatch modes: the plan rides on the context as a Python object."""

    @staticmethod
    def forward(ctx, x, topk_w, w1, w2, plan: _Plan, key: str):
        out, recv_x, kept, scale, *sched = _forward(x, topk_w, w1, w2, plan, key)
        ctx.plan, ctx.key = plan, key
        ctx.save_for_backward(x, topk_w, w1, w2, recv_x, kept, scale, *sched)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, topk_w, w1, w2, recv_x, kept, scale, *sched = ctx.saved_tensors
        return (*_backward(dout, x, topk_w, w1, w2, ctx.plan, recv_x, kept, scale, sched, ctx.key), None, None)


# Capacity dispatch under torch.compile: the same bodies as custom ops (the communication inside them, on a
# process group named by string), every plan tensor an output, so that the graph holds no Python object and no
# host sync; fixed shapes (ep·C rows) let it compile with fullgraph=True and run in a CUDA graph.
T = torch.Tensor
_N_FWD_IN = 12


@torch.library.custom_op("moeblaze::ep_capacity_fwd", mutates_args=())
def ep_capacity_fwd(x: T, topk_w: T, w1: T, w2: T, counts: T, offsets: T, eti: T, slot: T, group_name: str,
                    key: str, capacity: int, fail_on_overflow: bool
                    ) -> tuple[T, T, T, T, T, T, T, T, T, T, T, T, T, T, T]:
    group = _resolve_group(group_name)
    routing = RoutingIndex(counts, offsets, eti, slot)
    plan = _Plan(routing, dist.get_world_size(group), group, capacity, fail_on_overflow)
    out, recv_x, kept, scale, *sched = _forward(x, topk_w, w1, w2, plan, key)
    return (out, plan.needed.to(torch.int64), *plan.saved(), recv_x, kept, scale, *sched)


@ep_capacity_fwd.register_fake
def _(x, topk_w, w1, w2, counts, offsets, eti, slot, group_name, key, capacity, fail_on_overflow):
    ep = _resolve_group_size(group_name)
    E_loc, R, F, dev = w1.shape[0], ep * capacity, w1.shape[1], x.device
    tiles = R // BLOCK_M + E_loc
    ints = dict(dtype=torch.int32, device=dev)
    checkpoint = parse(key).checkpoint
    kept = {"preact": x.new_empty(R, F), "preact-fp8": x.new_empty(R, F, dtype=FP8)}.get(checkpoint, x.new_empty(0))
    scale = x.new_empty((R, -(-F // 128)) if checkpoint == "preact-fp8" else (0,), dtype=torch.float32)
    return (x.new_empty(x.shape), torch.empty((), dtype=torch.int64, device=dev), torch.empty(E_loc, **ints),
            torch.empty(E_loc + 1, **ints), torch.empty(R, **ints), torch.empty(R, 1, **ints),
            torch.empty(R, dtype=torch.int64, device=dev), torch.empty(slot.shape, **ints), torch.empty(1, **ints),
            x.new_empty(R, x.shape[1]) if checkpoint != "recompute" else x.new_empty(0), kept, scale,
            torch.empty(tiles, **ints), torch.empty(tiles, **ints), torch.empty(1, **ints))


@torch.library.custom_op("moeblaze::ep_capacity_bwd", mutates_args=())
def ep_capacity_bwd(dout: T, x: T, topk_w: T, w1: T, w2: T, counts: T, offsets: T, eti: T, slot: T, r_counts: T,
                    r_offsets: T, r_eti: T, r_slot: T, send_pos: T, slot_LK: T, kept: T, recv_x: T, preact: T,
                    scale: T, tile_expert: T, tile_row: T, tiles_used: T, group_name: str, key: str
                    ) -> tuple[T, T, T, T]:
    if dout.is_cuda:  # autograd runs backward on a thread of its own (see experts.op)
        ensure_context(dout.get_device())
    plan = _Plan.restore(RoutingIndex(counts, offsets, eti, slot), _resolve_group(group_name),
                         (r_counts, r_offsets, r_eti, r_slot, send_pos, slot_LK, kept))
    return _backward(dout, x, topk_w, w1, w2, plan, recv_x, preact, scale, (tile_expert, tile_row, tiles_used),
                     key)


@ep_capacity_bwd.register_fake
def _(dout, x, topk_w, w1, w2, *rest):
    return x.new_empty(x.shape), topk_w.new_empty(topk_w.shape), torch.empty_like(w1), torch.empty_like(w2)


def _capacity_setup_context(ctx, inputs, output):
    x, topk_w, w1, w2, counts, offsets, eti, slot = inputs[:8]
    ctx.group_name, ctx.key = inputs[8:10]
    ctx.save_for_backward(x, topk_w, w1, w2, counts, offsets, eti, slot, *output[2:])
    ctx.set_materialize_grads(False)


def _capacity_backward(ctx, dout, *_saved_outputs):
    if dout is None:
        return (None,) * _N_FWD_IN
    dx, dtopk_w, dw1, dw2 = ep_capacity_bwd(dout.contiguous(), *ctx.saved_tensors, ctx.group_name, ctx.key)
    return (dx, dtopk_w, dw1, dw2) + (None,) * (_N_FWD_IN - 4)


ep_capacity_fwd.register_autograd(_capacity_backward, setup_context=_capacity_setup_context)


def _group_name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def _resolve_group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _resolve_group_size(name: str) -> int:
    return dist.get_world_size(_resolve_group(name))




def check_options(config: ExpertsConfig) -> None:
    """ValueError or TypeError naming the option unless expert parallelism runs this recipe: the kernels, as one
    call on the received rows (the dispatch's own options are EPConfig's to check)."""
    if not isinstance(config, ExpertsConfig):
        raise TypeError(f"config must be a moeblaze.ExpertsConfig, got {type(config).__name__}")
    if config.backend == "reference":
        raise ValueError("expert parallelism runs the kernels: backend='reference' is not available under it")
    if config.chunk_tokens is not None:
        raise ValueError(f"chunk_tokens={config.chunk_tokens} does not apply under expert parallelism (the received "
                         "rows run as one call): leave it None, or bound the rows with dispatch='capacity'")


def check_same_on_ranks(value: int, what: str, group) -> None:
    """ValueError on every rank of `group` unless every rank passes the same value (one collective; every rank
    of the group calls it together)."""
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    if len(set(values)) > 1:
        raise ValueError(f"every rank must hold the same {what}; the ranks hold {values}")


_AGREED: set = set()  # (group, local experts) pairs whose ranks were checked to agree


def _check_local_experts(E_loc: int, group) -> None:
    """The ranks of `group` hold the same number of local experts: checked once per group and count (a collective),
    so that a split like 4 + 3 is one clear error on every rank, not an id error on one and a broken collective on
    the others."""
    key = (_group_name(group), E_loc)
    if key in _AGREED or torch.compiler.is_compiling():
        return
    check_same_on_ranks(E_loc, "number of local experts (w1_local.shape[0])", group)
    _AGREED.add(key)


def ep_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w1_local: torch.Tensor,
               w2_local: torch.Tensor, *, group=None, config: ExpertsConfig = DEFAULT,
               ep_config: EPConfig | None = None, tracker: CapacityTracker | None = None,
               dropped: torch.Tensor | None = None, **legacy) -> torch.Tensor:
    """The experts' combined output (L, D) for this rank's tokens x (L, D), routed to global expert ids topk_idx
    (L, K) with weights (L, K), over the experts sharded across `group` (default: the world): this rank holds
    experts [rank · E_loc, (rank + 1) · E_loc) as w1_local (E_loc, F, D) and w2_local (E_loc, D, H). Every rank of
    the group must call it (a rank without tokens passes L = 0). Differentiable in x, topk_weights and the local
    weights. config: the recipe, as for moe_experts (every precision and checkpoint policy; chunk_tokens is refused:
    the received rows run as one call, and dispatch="capacity" bounds them); the kernels run the experts (a GPU,
    or the interpreter on the CPU): backend "auto" is "triton" here, and "reference" is refused. Every rank must
    hold the same number of local experts (checked once per group and count, one collective).

    ep_config: the dispatch (moeblaze.EPConfig; None: exact). 0.2's form, its fields as keyword arguments, works with
    a DeprecationWarning.
    dispatch="capacity": C rows per (source, destination) pair, the same on every rank: `capacity`, or
    tracker.capacity, or ⌈capacity_factor · L · K / ep⌉ rounded up to 16 (then every rank must have the same L:
    the ranks check that they agree on C with the counts they exchange, and a disagreement is an error on every
    rank, a ValueError on CPU processes, a device-side assert on GPUs, before any row is sent).
    Overflow (a destination needing more than C rows): with a tracker, recorded for the caller's rerun (and
    dropped in this call); otherwise on_overflow "error" (default) or "drop". dropped: a device counter (an int64
    scalar) that the number of rows this rank drops is added to (no host sync), under on_overflow="drop".

    Args:
        x: (L, D) this rank's tokens, float.
        topk_idx, topk_weights: (L, K) global expert ids (int) and their weights (float).
        w1_local, w2_local: (E_loc, F, D) and (E_loc, D, H), this rank's experts.
        group: the expert-parallel process group (None: the world).
        config: the experts' moeblaze.ExpertsConfig.
        ep_config: the dispatch, a moeblaze.EPConfig (None: exact).
        tracker: a CapacityTracker sizing capacity dispatch, or None.
        dropped: an int64 scalar tensor counting the rows this rank drops (on_overflow="drop"), or None.

    Returns:
        (L, D) in x's dtype: this rank's tokens' combined expert outputs.
    """
    config = from_legacy("ep_experts", config, {})
    check_options(config)
    ep_config = ep_from_legacy("ep_experts", ep_config, legacy)
    if tracker is not None and ep_config.dispatch != "capacity":
        raise ValueError("a CapacityTracker sizes capacity dispatch: it needs ep_config=EPConfig(dispatch='capacity')")
    ep = dist.get_world_size(group)
    check_expert_inputs(x, w1_local, w2_local, config.activation)
    _check_local_experts(w1_local.shape[0], group)
    E = w1_local.shape[0] * ep
    routing = build_routing_index(topk_idx, E, config.index_method)
    check_topk_weights(topk_weights, routing.token_slot)
    C = None
    if ep_config.dispatch == "capacity":
        C = ep_config.capacity if ep_config.capacity is not None else tracker.capacity if tracker is not None else None
        if C is None:
            C = -(-max(1, math.ceil(ep_config.factor * topk_idx.numel() / ep)) // 16) * 16
    backend = choose("triton" if config.backend == "auto" else config.backend, x.device)
    key = kernel_op_key(x, config, backend, C is not None, False)  # the receiver's index has padding rows (capacity)
    fail = ep_config.overflow == "error" and tracker is None
    if C is not None and torch.compiler.is_compiling():
        outs = ep_capacity_fwd(x, topk_weights, w1_local, w2_local, *routing.tensors(), _group_name(group), key, C,
                               fail)
        out, needed = outs[0], outs[1]
    else:
        plan = _Plan(routing, ep, group, C, fail)
        out = _EPExperts.apply(x, topk_weights, w1_local, w2_local, plan, key)
        needed = plan.needed
    if tracker is not None and needed is not None:
        tracker.record(needed)
    if dropped is not None and C is not None and ep_config.overflow == "drop" and tracker is None:
        per_dest = routing.expert_counts.view(ep, -1).sum(1)  # the rows for each destination, C of them sent
        dropped.add_((per_dest - C).clamp(min=0).sum())
    return out
