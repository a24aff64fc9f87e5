"""The transport of one expert-parallel layer call (Transport, the seam between the op's bodies and the
communication): which rows each rank sends, how the receiver indexes what arrives (receiver_index: a K = 1 routing
index in the global token order, no sort), where each pair's returned row lands, and the all-to-alls that move them.
ExactPlan and CapacityPlan implement it (make_plan builds one per forward call, restore_plan brings it back in
backward from its PlanTensors, by field name); capacity dispatch's overflow rule and CapacityTracker.
distributed.ep's header describes the data flow and both dispatch modes.

Memory: the plan holds O(L·K + R) int32 (the receiver's index, the send positions and the pairs' return slots) and,
in exact mode, the split sizes on the host; it allocates no row buffer of its own beyond the all-to-alls' outputs.

Legend: ep ranks, E experts (E_loc = E / ep per rank), L tokens and K experts per token on this rank, R rows
received, D hidden.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from ..experts.stages import combine_slots
from ..routing import RoutingIndex, build_routing_index
from ..routing.index import pair_experts


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


class PlanTensors(NamedTuple):
    """A plan's tensors, what backward gets back (EPKept.plan): the receiver's index, the send positions (empty:
    every row, in expert order), each pair's slot in the return buffer and the rows kept there (both empty: the
    routing's own), and the exact splits (2, ep) on the host (empty: capacity dispatch, which they tell apart)."""
    recv_counts: torch.Tensor
    recv_offsets: torch.Tensor
    recv_token_idx: torch.Tensor
    recv_slot: torch.Tensor
    send_pos: torch.Tensor
    slot_LK: torch.Tensor
    kept_rows: torch.Tensor
    splits: torch.Tensor


class Transport(Protocol):
    """How an expert-parallel layer call moves rows: the seam between the op's bodies (distributed.ep) and the
    communication. A transport is built per forward call (its collectives run there), restored in backward from its
    tensors without communicating, and moves rows both ways; ExactPlan and CapacityPlan are the two here, and
    another one (a different library's all-to-all, an overlapped one) implements the same members.

    routing: the sender's RoutingIndex over all E experts; recv: the receiver's (K = 1, over its local experts;
    dropped pairs as padding); slot_LK and kept: each pair's row in the return buffer, slots >= kept dropped;
    needed: the most rows any destination needed from this rank (0-d int64; capacity dispatch's overflow check)."""
    routing: RoutingIndex
    recv: RoutingIndex
    slot_LK: torch.Tensor
    kept: torch.Tensor
    needed: torch.Tensor | None

    def tensors(self) -> PlanTensors: ...

    def in_send_order(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (in the sender's expert order) as the send buffer lays them out."""

    def send(self, rows_LD: torch.Tensor) -> torch.Tensor:
        """The send buffer of rows_LD (x or dy): its rows in send order, gathered through the routing index."""

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """A send buffer's rows to the ranks that hold their experts: the rows received (R of them)."""

    def give_back(self, rows: torch.Tensor) -> torch.Tensor:
        """The receiver's R rows back to their senders: the return buffer."""

    def combine(self, rows: torch.Tensor, weights_LK, out_dtype) -> torch.Tensor:
        """The sender's combine of returned rows: sum_k (w[t, k] ·) rows[slot[t, k]], dropped slots adding 0."""


def make_plan(routing: RoutingIndex, ep: int, group, capacity: int | None, fail_on_overflow: bool) -> Transport:
    """The transport of one forward call: exact dispatch (capacity None) or capacity dispatch with C = capacity."""
    if capacity is None:
        return ExactPlan(routing, ep, group)
    return CapacityPlan(routing, ep, group, capacity, fail_on_overflow)


def restore_plan(routing: RoutingIndex, group, saved: PlanTensors) -> Transport:
    """The transport whose tensors `saved` holds (EPKept.plan), without any communication."""
    return (ExactPlan if saved.splits.numel() else CapacityPlan).restore(routing, group, saved)


class _Rows:
    """What both transports share: the gather into the send buffer, the all-to-alls by their split sizes (None:
    equal), and the combine through the pairs' slots."""
    send_pos: torch.Tensor | None = None
    in_splits: list[int] | None = None
    out_splits: list[int] | None = None

    def in_send_order(self, rows: torch.Tensor) -> torch.Tensor:
        if self.send_pos is None:
            return rows
        if rows.shape[0] == 0:
            return rows.new_zeros((self.send_pos.shape[0],) + tuple(rows.shape[1:]))
        return rows[self.send_pos]

    def send(self, rows_LD: torch.Tensor) -> torch.Tensor:
        if rows_LD.shape[0] == 0:  # no tokens here
            return self.in_send_order(rows_LD)
        return rows_LD[self.in_send_order(self.routing.expert_token_idx).long()]

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        return _all_to_all(rows, self.out_splits, self.in_splits, self.group)

    def give_back(self, rows: torch.Tensor) -> torch.Tensor:
        return _all_to_all(rows, self.in_splits, self.out_splits, self.group)

    def combine(self, rows: torch.Tensor, weights_LK, out_dtype) -> torch.Tensor:
        return combine_slots(rows, self.slot_LK, weights_LK, self.kept, out_dtype)


class ExactPlan(_Rows):
    """Exact dispatch: every routed row, variable split sizes read on the host once (the one sync of the call);
    the receiver gets R = the rows routed to it, the pairs' slots are the routing's own."""

    def __init__(self, routing: RoutingIndex, ep: int, group):
        self.routing, self.group = routing, group
        send_counts = routing.expert_counts.view(ep, -1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
        self.splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).cpu()  # the one host sync
        self.in_splits, self.out_splits = self.splits.tolist()
        self.recv = receiver_index(recv_counts)
        self.needed = torch.zeros((), dtype=torch.int64, device=routing.token_slot.device)
        self.slot_LK, self.kept = routing.token_slot, routing.expert_offsets[-1:]

    def tensors(self) -> PlanTensors:
        none = self.slot_LK.new_empty(0)
        return PlanTensors(*self.recv.tensors(), send_pos=none, slot_LK=none, kept_rows=none, splits=self.splits)

    @classmethod
    def restore(cls, routing: RoutingIndex, group, saved: PlanTensors) -> ExactPlan:
        plan = cls.__new__(cls)
        plan.routing, plan.group, plan.needed, plan.splits = routing, group, None, saved.splits
        plan.in_splits, plan.out_splits = saved.splits.tolist()
        plan.slot_LK, plan.kept = routing.token_slot, routing.expert_offsets[-1:]
        plan.recv = RoutingIndex(saved.recv_counts, saved.recv_offsets, saved.recv_token_idx, saved.recv_slot)
        return plan


class CapacityPlan(_Rows):
    """Capacity dispatch: C rows per (source, destination) pair, equal splits, no host sync (but under
    on_overflow="error": fail_on_overflow); a destination's rows past C in its expert order are dropped (or the
    call fails, every rank together), the receiver's padding rows are dropped pairs of its index."""

    def __init__(self, routing: RoutingIndex, ep: int, group, capacity: int, fail_on_overflow: bool):
        self.routing, self.group = routing, group
        E = routing.num_experts
        E_loc, P, dev = E // ep, routing.expert_token_idx.shape[0], routing.token_slot.device
        send_counts = routing.expert_counts.view(ep, E_loc)
        per_dest = send_counts.sum(1)  # (ep,) rows for each destination
        # rows past C in a destination's expert order are dropped: clip the per-expert counts there
        cum = send_counts.cumsum(1).clamp(max=capacity)
        kept_counts = torch.diff(cum, dim=1, prepend=torch.zeros_like(cum[:, :1]))
        # each destination gets this rank's capacity with its counts: the row all-to-all's equal splits need the
        # same C on every rank, which a capacity sized from each rank's own token count breaks on uneven batches
        sent = torch.cat([kept_counts, kept_counts.new_full((ep, 1), capacity)], 1)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=group)
        recv_counts = got[:, :E_loc]
        self.needed = (per_dest.max() if P else per_dest.new_zeros(())).to(torch.int64)
        mismatch = (got[:, E_loc] != capacity).any()
        mismatched = ("capacity dispatch: the ranks use different capacities (this rank "
                      f"{capacity} rows per pair): with different token counts per rank, pass the same capacity= on "
                      "every rank or a CapacityTracker instead of sizing it by capacity_factor")
        checks = [(mismatch, mismatched, ValueError)]
        if fail_on_overflow:  # a Python error on every rank, read on the host: not in a CUDA graph
            if mismatch.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ValueError("capacity dispatch: on_overflow='error' reads the overflow on the host (a Python "
                                 "error on every rank), which a CUDA graph can't: under capture use "
                                 "on_overflow='drop' (the dropped rows counted) or a CapacityTracker")
            checks.append((self.needed > capacity, f"capacity dispatch: a destination needs more than {capacity} "
                           "rows (raise the capacity factor, pass on_overflow='drop', or use a CapacityTracker); no "
                           "row was sent", CapacityOverflow))
        fail_if_any(checks, group, sync=fail_on_overflow)
        self.splits = torch.empty(0, dtype=torch.int64, device=dev)
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

    def tensors(self) -> PlanTensors:
        return PlanTensors(*self.recv.tensors(), send_pos=self.send_pos, slot_LK=self.slot_LK, kept_rows=self.kept,
                           splits=self.splits)

    @classmethod
    def restore(cls, routing: RoutingIndex, group, saved: PlanTensors) -> CapacityPlan:
        plan = cls.__new__(cls)
        plan.routing, plan.group, plan.needed, plan.splits = routing, group, None, saved.splits
        plan.send_pos, plan.slot_LK, plan.kept = saved.send_pos, saved.slot_LK, saved.kept_rows
        plan.recv = RoutingIndex(saved.recv_counts, saved.recv_offsets, saved.recv_token_idx, saved.recv_slot,
                                 dropped=True)
        return plan


class CapacityOverflow(RuntimeError):
    """Capacity dispatch under on_overflow="error": a destination needed more rows than the capacity. Raised on
    every rank together, before any row is sent: the job can catch it, save, and go on with a larger capacity."""


def fail_if_any(checks: list, group, sync: bool = False) -> None:
    """For each (bad, message, error) of checks, in order: error(message) on every rank of `group` together where
    the 0-d bool `bad` holds on any rank. On the CPU, where a host read is free, or with sync: one all-reduce of
    every flag and one host read (on a GPU a sync), so that no rank is left waiting in the next collective and the
    process, its CUDA context intact, can save (on_overflow="error"). Without sync on a GPU: device-side asserts,
    no host sync; the program stops, and the other ranks with it (on_overflow "drop" and a tracker's capacity
    check, which must not sync)."""
    if checks[0][0].device.type != "cpu" and not sync:
        for bad, message, _ in checks:
            torch._assert_async(~bad, message)
        return
    flags = torch.stack([bad.reshape(()) for bad, _, _ in checks]).to(torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    for flag, (_, message, error) in zip(flags.tolist(), checks):
        if flag:
            raise error(message)
