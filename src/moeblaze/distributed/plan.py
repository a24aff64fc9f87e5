"""The transport of one expert-parallel layer call (Transport, the seam between the op's bodies and the
communication): which rows each rank sends, how the receiver indexes what arrives (receiver_index: a K = 1 routing
index in the global token order, no sort), where each pair's returned row lands, and the all-to-alls that move them.
ExactPlan and CapacityPlan implement it (make_plan builds one per forward call, restore_plan brings it back in
backward from its PlanTensors, by field name); capacity dispatch's overflow rule and CapacityTracker.
distributed.ep's header describes the data flow and both dispatch modes.
Groups: exact dispatch with chunks = G > 1 splits the local experts into G contiguous groups (Group), each with
its own all-to-alls, issued without waiting, and its own receiver index: the send buffer is laid out group-major
(group, destination, expert, token), so each group's rows are one block of it, and each expert's rows arrive in
the same (source, token) order as with one group. The op's bodies run group by group, a group's GEMMs under the
next group's dispatch and the previous group's return (distributed.ep).

Memory: the plan holds O(L·K + R) int32 (the receiver's index, the send positions and the pairs' return slots) and,
in exact mode, the split sizes on the host; it allocates no row buffer of its own beyond the all-to-alls' outputs.

Legend: ep ranks, E experts (E_loc = E / ep per rank), L tokens and K experts per token on this rank, R rows
received, D hidden.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from ..args import check_int
from ..experts.stages import combine_slots
from ..routing import RoutingIndex, build_routing_index
from ..routing.checks import device_message, fail_if
from ..routing.index import pair_experts
from .stops import assert_none, exchange, stop_if_any


def receiver_index(counts_SE: torch.Tensor, rows: int | None = None) -> RoutingIndex:
    """The K = 1 routing index of rows received grouped by source rank, then local expert (counts_SE (ep, E_loc):
    rows from source s for local expert e), over the E_loc local experts: expert-major, then source, then
    arrival order. One pass of O(R) index arithmetic, no sort; R = rows (the sum of counts_SE), read on the host
    where not given (repeat_interleave's size)."""
    S, E = counts_SE.shape
    c = counts_SE.to(torch.int64)
    start_SE = (c.flatten().cumsum(0) - c.flatten()).view(S, E)  # first received row of each (source, expert)
    size_ES = c.t().flatten()  # the same blocks in expert-major order
    R = int(size_ES.sum()) if rows is None else rows
    block = torch.repeat_interleave(torch.arange(S * E, device=c.device), size_ES, output_size=R)
    first = size_ES.cumsum(0) - size_ES  # each block's first position in expert-major order
    rows = start_SE.t().flatten()[block] + torch.arange(R, device=c.device) - first[block]
    slot = torch.empty(R, dtype=torch.int32, device=c.device)
    slot[rows] = torch.arange(R, dtype=torch.int32, device=c.device)
    counts_E = c.sum(0)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=c.device)
    offsets[1:] = counts_E.cumsum(0)
    return RoutingIndex(counts_E.int(), offsets, rows.int(), slot.view(R, 1))


def expert_groups(E_loc: int, chunks: int) -> list[tuple[int, int]]:
    """The local experts [0, E_loc) in `chunks` contiguous groups of near-equal size (the first ones one larger)."""
    q, r = divmod(E_loc, chunks)
    bounds = [0]
    for g in range(chunks):
        bounds.append(bounds[-1] + q + (g < r))
    return list(zip(bounds[:-1], bounds[1:]))


class Group(NamedTuple):
    """One group of local experts and its rows: experts (a slice of the local experts), rows (its block of the
    receive buffer), send (its block of the send and return buffers; each None where one group holds everything),
    the split sizes of its all-to-all (None: equal splits), and its receiver index (over its experts, rows counted
    from its block's start)."""
    experts: slice | None
    rows: slice | None
    send: slice | None
    in_splits: list[int] | None
    out_splits: list[int] | None
    recv: RoutingIndex


def part(t: torch.Tensor | None, s: slice | None) -> torch.Tensor | None:
    """t's block s along dim 0 (t itself where s is None: one group)."""
    return t if t is None or s is None else t[s]


def resolve_group(name: str):
    """The process group of that name (the custom ops carry groups by name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


class Traffic:
    """The bytes this process's expert-parallel all-to-alls sent to other ranks (its own block, a local copy,
    excluded), counted from the split sizes the host already holds: `sent` since the last reset(). Not counted
    inside a torch.compile trace (the trace runs once)."""
    sent = 0

    @classmethod
    def reset(cls) -> int:
        """The bytes counted so far, and the count set to 0."""
        n, cls.sent = cls.sent, 0
        return n


def _count(t: torch.Tensor, in_splits: list[int] | None, group) -> None:
    if torch.compiler.is_compiling() or t.numel() == 0:
        return
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = t.shape[0]
    own = in_splits[rank] if in_splits is not None else rows // ep
    Traffic.sent += (rows - own) * (t.numel() // rows) * t.element_size()


def _all_to_all(out: torch.Tensor, t: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
                group, async_op: bool = False):
    """t's rows split by in_splits (equal splits where None) to the ranks of group, received into out; the work
    handle where async_op (wait on it before reading out or letting t go), else None. Counted in Traffic."""
    _count(t, in_splits, group)
    return dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group, async_op=async_op)


def wait(handles) -> None:
    """Wait on all-to-all work handles (None: done already)."""
    for h in handles:
        if h is not None:
            h.wait()


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
        check_int("capacity", capacity)
        check_int("multiple", multiple)
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
    """A plan's tensors, what backward gets back (EPKept.plan): the receiver's index (its groups' indexes one after
    another), the send positions (empty: every row, in expert order), each pair's slot in the return buffer and the
    rows kept there (both empty: the routing's own), and the exact splits (2, groups, ep) on the host (empty:
    capacity dispatch, which they tell apart)."""
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

    routing: the sender's RoutingIndex over all E experts; groups: the local experts' groups (Group: one, unless
    the plan pipelines), each with its receiver index (K = 1, over its experts; dropped pairs as padding); slot_LK
    and kept: each pair's row in the return buffer, slots >= kept dropped; needed: the most rows any destination
    needed from this rank (0-d int64; capacity dispatch's overflow check)."""
    routing: RoutingIndex
    groups: list[Group]
    slot_LK: torch.Tensor
    kept: torch.Tensor
    needed: torch.Tensor | None

    def tensors(self) -> PlanTensors: ...

    def in_send_order(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (in the sender's expert order) as the send buffer lays them out."""

    def send(self, rows_LD: torch.Tensor) -> torch.Tensor:
        """The send buffer of rows_LD (x or dy): its rows in send order, gathered through the routing index."""

    def dispatch_groups(self, rows: torch.Tensor) -> tuple[torch.Tensor, list]:
        """A send buffer's rows to the ranks that hold their experts, group by group: the receive buffer (R rows)
        and a handle per group (wait(...) on it before reading the group's block)."""

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """dispatch_groups, every group arrived: the rows received."""

    def return_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """An empty return buffer for rows like `like`'s (its trailing shape and dtype)."""

    def give_back_group(self, rows: torch.Tensor, group: Group, into: torch.Tensor):
        """A group's rows back to their senders, into its block of the return buffer `into`: a handle (keep rows
        until it is waited on)."""

    def give_back(self, rows: torch.Tensor) -> torch.Tensor:
        """The receiver's R rows back to their senders, every group: the return buffer."""

    def combine(self, rows: torch.Tensor, weights_LK, out_dtype) -> torch.Tensor:
        """The sender's combine of returned rows: sum_k (w[t, k] ·) rows[slot[t, k]], dropped slots adding 0."""


def make_plan(routing: RoutingIndex, ep: int, group, capacity: int | None, fail_on_overflow: bool,
              chunks: int = 1, agreed: int = 0) -> Transport:
    """The transport of one forward call: exact dispatch (capacity None) in `chunks` groups, or capacity dispatch
    with C = capacity; agreed: the call's signature (stops.exchange)."""
    if capacity is None:
        return ExactPlan(routing, ep, group, chunks, agreed)
    return CapacityPlan(routing, ep, group, capacity, fail_on_overflow, agreed)


def restore_plan(routing: RoutingIndex, group, saved: PlanTensors) -> Transport:
    """The transport whose tensors `saved` holds (EPKept.plan), without any communication."""
    return (ExactPlan if saved.splits.numel() else CapacityPlan).restore(routing, group, saved)


class _Rows:
    """What both transports share: the gather into the send buffer, the all-to-alls group by group by their split
    sizes (None: equal), issued without waiting where there are several groups, and the combine through the pairs'
    slots. received, sent: the rows of the receive and of the send (and return) buffer."""
    send_pos: torch.Tensor | None = None
    groups: list[Group]
    received: int
    sent: int

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

    def dispatch_groups(self, rows: torch.Tensor) -> tuple[torch.Tensor, list]:
        out = rows.new_empty((self.received,) + tuple(rows.shape[1:]))
        pipelined = len(self.groups) > 1
        return out, [_all_to_all(part(out, g.rows), part(rows, g.send), g.out_splits, g.in_splits, self.group,
                                 pipelined) for g in self.groups]

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        out, handles = self.dispatch_groups(rows)
        wait(handles)
        return out

    def return_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_empty((self.sent,) + tuple(like.shape[1:]))

    def give_back_group(self, rows: torch.Tensor, group: Group, into: torch.Tensor):
        return _all_to_all(part(into, group.send), rows, group.in_splits, group.out_splits, self.group,
                           len(self.groups) > 1)

    def give_back(self, rows: torch.Tensor) -> torch.Tensor:
        out = self.return_buffer(rows)
        wait([self.give_back_group(part(rows, g.rows), g, out) for g in self.groups])
        return out

    def combine(self, rows: torch.Tensor, weights_LK, out_dtype) -> torch.Tensor:
        return combine_slots(rows, self.slot_LK, weights_LK, self.kept, out_dtype)

    def _recv_tensors(self) -> tuple:
        """The groups' receiver indexes, one after another (PlanTensors' first four)."""
        recvs = [g.recv.tensors() for g in self.groups]
        return recvs[0] if len(recvs) == 1 else tuple(torch.cat(ts) for ts in zip(*recvs))


class ExactPlan(_Rows):
    """Exact dispatch: every routed row, variable split sizes read on the host once (the one sync of the call);
    the receiver gets R = the rows routed to it. With chunks > 1 the local experts go in that many groups (the
    module header): the send buffer group-major (send_pos) and the pairs' slots with it; else the slots are the
    routing's own."""

    def __init__(self, routing: RoutingIndex, ep: int, group, chunks: int = 1, agreed: int = 0):
        self.routing, self.group = routing, group
        send_counts = routing.expert_counts.view(ep, -1).to(torch.int64)
        recv_counts, stops = exchange(send_counts, group, agreed)
        bounds = expert_groups(send_counts.shape[1], chunks)
        per_group = [torch.stack([c[:, a:b].sum(1) for a, b in bounds]) for c in (send_counts, recv_counts)]
        host = torch.cat([torch.stack(per_group).flatten(), stops]).cpu()  # the one host sync
        stop_if_any(host[-ep:])
        self.splits = host[:-ep].view(2, len(bounds), ep)  # (2, groups, ep)
        rows = self.splits[1].sum(1).tolist()
        recvs = [receiver_index(recv_counts[:, a:b], n) for (a, b), n in zip(bounds, rows)]
        self.needed = torch.zeros((), dtype=torch.int64, device=routing.token_slot.device)
        self._place(bounds, recvs)
        if chunks > 1:
            self._group_major(bounds, ep)

    def _place(self, bounds: list[tuple[int, int]], recvs: list[RoutingIndex]) -> None:
        """The groups from their experts' bounds, the splits and their receiver indexes; the routing's own slots
        (one group)."""
        ins, outs = self.splits.tolist()
        one = len(ins) == 1
        self.groups, sent, received = [], 0, 0
        for (a, b), i, o, recv in zip(bounds, ins, outs, recvs):
            self.groups.append(Group(None if one else slice(a, b), None if one else slice(received, received + sum(o)),
                                     None if one else slice(sent, sent + sum(i)), i, o, recv))
            sent, received = sent + sum(i), received + sum(o)
        self.sent, self.received = sent, received
        self.slot_LK, self.kept = self.routing.token_slot, self.routing.expert_offsets[-1:]

    def _group_major(self, bounds: list[tuple[int, int]], ep: int) -> None:
        """The send buffer group-major: row r of the sender's expert order (destination d's expert e of group g)
        goes to block (g, d), at its place past the block's first row; send_pos is that order's inverse, and each
        pair's slot moves with its row (rows past the routed ones, dropped pairs, stay where they are)."""
        offs = self.routing.expert_offsets.to(torch.int64)
        E_loc, P, dev = (offs.shape[0] - 1) // ep, self.routing.expert_token_idx.shape[0], offs.device
        lo = torch.tensor([a for a, _ in bounds], device=dev)
        hi = torch.tensor([b for _, b in bounds], device=dev)
        dests = torch.arange(ep, device=dev) * E_loc
        first = offs[dests[None, :] + lo[:, None]]  # (groups, ep): each block's first row in expert order
        size = offs[dests[None, :] + hi[:, None]] - first
        start = (size.flatten().cumsum(0) - size.flatten()).view_as(size)  # its first row group-major
        group_of = torch.repeat_interleave(torch.arange(len(bounds), device=dev), hi - lo)
        r = torch.arange(P, device=dev)
        e = torch.searchsorted(offs[1:], r, right=True)  # each row's expert (E past the routed rows)
        routed = e < ep * E_loc
        e = e.clamp(max=ep * E_loc - 1)
        g, d = group_of[e % E_loc], e // E_loc
        moved = torch.where(routed, start[g, d] + r - first[g, d], r)
        self.send_pos = torch.empty_like(moved)
        self.send_pos[moved] = r
        self.slot_LK = moved[self.routing.token_slot.long()].to(self.routing.token_slot.dtype)

    def tensors(self) -> PlanTensors:
        none = self.slot_LK.new_empty(0)
        moved = self.send_pos is not None
        return PlanTensors(*self._recv_tensors(), send_pos=self.send_pos if moved else none,
                           slot_LK=self.slot_LK if moved else none, kept_rows=none, splits=self.splits)

    @classmethod
    def restore(cls, routing: RoutingIndex, group, saved: PlanTensors) -> ExactPlan:
        plan = cls.__new__(cls)
        plan.routing, plan.group, plan.needed, plan.splits = routing, group, None, saved.splits
        ins, outs = saved.splits.tolist()
        E_loc = saved.recv_counts.shape[0]
        bounds = expert_groups(E_loc, len(ins))
        rows = [sum(o) for o in outs]
        sizes = ([b - a for a, b in bounds], [b - a + 1 for a, b in bounds], rows, rows)
        parts = [t.split(n) for t, n in zip(saved[:4], sizes)]
        plan._place(bounds, [RoutingIndex(*ts) for ts in zip(*parts)])
        if saved.send_pos.numel() or saved.slot_LK.numel():
            plan.send_pos, plan.slot_LK = saved.send_pos, saved.slot_LK
        return plan


class CapacityPlan(_Rows):
    """Capacity dispatch: C rows per (source, destination) pair, equal splits, no host sync (but under
    on_overflow="error": fail_on_overflow); a destination's rows past C in its expert order are dropped (or the
    call fails, every rank together), the receiver's padding rows are dropped pairs of its index."""

    def __init__(self, routing: RoutingIndex, ep: int, group, capacity: int, fail_on_overflow: bool,
                 agreed: int = 0):
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
        sent = torch.cat([kept_counts, kept_counts.new_full((ep, 1), capacity)], 1).to(torch.int64)
        got, stops = exchange(sent, group, agreed)
        recv_counts = got[:, :E_loc]
        self.needed = (per_dest.max() if P else per_dest.new_zeros(())).to(torch.int64)
        capacity_checks(got[:, E_loc] != capacity, self.needed, capacity, fail_on_overflow, group, stops)
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
        self._one_group()

    def _one_group(self) -> None:
        self.groups = [Group(None, None, None, None, None, self.recv)]
        self.sent = self.received = self.send_pos.shape[0]  # ep·C rows each way

    def tensors(self) -> PlanTensors:
        return PlanTensors(*self._recv_tensors(), send_pos=self.send_pos, slot_LK=self.slot_LK, kept_rows=self.kept,
                           splits=self.splits)

    @classmethod
    def restore(cls, routing: RoutingIndex, group, saved: PlanTensors) -> CapacityPlan:
        plan = cls.__new__(cls)
        plan.routing, plan.group, plan.needed, plan.splits = routing, group, None, saved.splits
        plan.send_pos, plan.slot_LK, plan.kept = saved.send_pos, saved.slot_LK, saved.kept_rows
        plan.recv = RoutingIndex(saved.recv_counts, saved.recv_offsets, saved.recv_token_idx, saved.recv_slot,
                                 dropped=True)
        plan._one_group()
        return plan


class CapacityOverflow(RuntimeError):
    """Capacity dispatch under on_overflow="error": a destination needed more rows than the capacity. Raised on
    every rank together, before any row is sent: the job can catch it, save, and go on with a larger capacity."""


def capacity_checks(mismatch: torch.Tensor, needed: torch.Tensor, capacity: int, fail_on_overflow: bool,
                    group, stops: torch.Tensor) -> None:
    """Capacity dispatch's checks, before any row is sent, as errors on every rank together (fail_if_any): every
    rank's call agrees with this one's and none refused its inputs (stops, from stops.exchange), the ranks'
    capacities agree (mismatch: this rank got another capacity from some rank), and under on_overflow="error"
    (fail_on_overflow) no destination needs more than `capacity` rows (needed: the most one needs from this rank)."""
    # every rank holds every rank's code: checked without a collective, which a refusing rank no longer makes;
    # read on the host where that is free or made anyway, else a device-side assert (the program stops)
    if stops.device.type == "cpu" or fail_on_overflow:
        stop_if_any(stops)
    else:
        assert_none(stops)
    checks = [(mismatch.any(), "capacity dispatch: the ranks use different capacities (this rank "
               f"{capacity} rows per pair): with different token counts per rank, pass the same capacity= on every "
               "rank or a CapacityTracker instead of sizing it by capacity_factor", ValueError)]
    if fail_on_overflow:  # a Python error on every rank, read on the host: not in a CUDA graph
        if mismatch.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError("capacity dispatch: on_overflow='error' reads the overflow on the host (a Python error "
                             "on every rank), which a CUDA graph can't: under capture use on_overflow='drop' (the "
                             "dropped rows counted) or a CapacityTracker")
        checks.append((needed > capacity, f"capacity dispatch: a destination needs more than {capacity} rows (raise "
                       "the capacity factor, pass on_overflow='drop', or use a CapacityTracker); no row was sent",
                       CapacityOverflow))
    fail_if_any(checks, group, sync=fail_on_overflow)


def fail_if_any(checks: list, group, sync: bool = False) -> None:
    """For each (bad, message, error) of checks, in order: error(message) on every rank of `group` together where
    the 0-d bool `bad` holds on any rank. On the CPU, where a host read is free, or with sync: one all-reduce of
    every flag and one host read (on a GPU a sync), so that no rank is left waiting in the next collective and the
    process, its CUDA context intact, can save (on_overflow="error"). Without sync on a GPU: device-side asserts,
    no host sync; the program stops, and the other ranks with it (on_overflow "drop" and a tracker's capacity
    check, which must not sync)."""
    if checks[0][0].device.type != "cpu" and not sync:
        for bad, message, error in checks:
            fail_if(bad, message, error)
        return
    for _, message, _ in checks:  # the same messages as on the device path
        device_message(message)
    flags = torch.stack([bad.reshape(()) for bad, _, _ in checks]).to(torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    for flag, (_, message, error) in zip(flags.tolist(), checks):
        if flag:
            raise error(message)
