"""The "pairs" transport of expert parallelism (distributed.ep): one row per (token, expert) pair sent to the rank
holding the expert and back, with the zero-buffer routing index on both sides; each rank's results equal one GPU's
bit for bit (the bitwise reference; distributed.tokens sends a token once per rank instead).

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
  capacity  C rows per (source, destination) pair, equal splits. A destination's rows past C (in its expert order)
            are overflow: never silent. on_overflow="error" raises CapacityOverflow on every rank before any row is
            sent (one all-reduced flag read on the host: a sync, and refused under CUDA-graph capture); "drop"
            drops them (they add nothing, as transformers' sentinels; counted where `dropped` is given) and a
            CapacityTracker records the rows each destination needed so that the caller can grow C and rerun the
            step, both without a host sync. The
            receiver's padding rows are dropped pairs of its index (routing.index's sentinels): never computed.
            R = ep·C.
  exact with chunks = G > 1: the local experts in G groups (plan.Group), each group's all-to-alls issued without
            waiting and the op's bodies run group by group, so that a group's GEMMs run under the next group's
            dispatch and the previous group's return; each expert gets the same rows in the same order, so the
            results are bitwise those of one group. The send buffer lives until the last group's rows have left,
            and the weights' gradients are joined from the groups' (a transient of their size).
Autograd: one custom-op pair, moeblaze::ep_fwd / ep_bwd (EP), for both modes, its schemas and fakes derived from
EPInputs, EPKept and the op's Kept (experts.op); its bodies are the collectives around the op's own forward and
backward bodies on the received rows. torch.compile traces it under capacity dispatch; eager mode calls its bodies
directly, as the op does (distributed.ep_op derives it from EPInputs, EPKept and the bodies, as for tokens). The
op's router-weight factor stays inside the op's backward (the sender combines with the weights in forward, the
receiver applies them in dA''s epilogue), which is what makes each rank bitwise equal to one GPU.
Memory kept per layer, beyond the routing indexes (O(L·K + R) int32) and the tile schedule: under
checkpoint="preact" the received rows R·D and the pre-activation R·F; under "recompute" nothing more: the rows are
sent again in backward and the pre-activation recomputed. Transient: the send and return buffers (L·K·D each in
exact mode, ep·C·D in capacity mode).

Legend: ep ranks, E experts (E_loc = E / ep per rank), L tokens and K experts per token on this rank, R rows
received, D hidden, F rows of W1 per expert.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..experts.op import Kept, OpInputs, experts_backward, experts_forward, kept_like, parse
from ..launch import ensure_context
from ..routing import RoutingIndex, build_routing_index
from ..routing.index import in_row_order
from .ep_op import EPOptions, declare_ep_op, run_ep_op
from .plan import Group, PlanTensors, make_plan, part, resolve_group, restore_plan, wait


class EPInputs(NamedTuple):
    """The expert-parallel op's tensor inputs, the sender's side: x (L, D), the router weights (L, K), this rank's
    experts w1 (E_loc, F, D) and w2 (E_loc, D, H), the routing index over all E experts, and W1's up rows apart
    (w1_up, as for the op: w1 then holds the gate rows)."""
    x: torch.Tensor
    topk_w: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    expert_token_idx: torch.Tensor
    token_slot: torch.Tensor
    w1_up: torch.Tensor | None = None

    @property
    def routing(self) -> RoutingIndex:
        return RoutingIndex(self.expert_counts, self.expert_offsets, self.expert_token_idx, self.token_slot)


class EPKept(NamedTuple):
    """What the forward hands the backward: the transport's tensors (plan.PlanTensors), the received rows (empty
    under "recompute": sent again) and the op's own Kept, one per group of local experts (plan.Group): a repeated
    group, which the custom ops' schemas name once (the traced path, capacity dispatch, has one)."""
    plan: PlanTensors
    recv_x: torch.Tensor
    ops: tuple[Kept, ...]


def _keeps_rows(key: str) -> bool:
    """Whether the received rows are kept for backward (else sent again): unless the recipe recomputes."""
    return parse(key).checkpoint != "recompute"


def _group_inputs(rows: torch.Tensor, weights: torch.Tensor, inputs: EPInputs, g: Group) -> OpInputs:
    """The op's inputs for group g: its received rows, their weights, its experts' weights (views) and its index."""
    return OpInputs.of(part(rows, g.rows), part(inputs.w1, g.experts), part(inputs.w2, g.experts),
                       part(weights, g.rows), g.recv, w1_up=part(inputs.w1_up, g.experts))


def ep_forward(inputs: EPInputs, o: EPOptions) -> tuple[torch.Tensor, torch.Tensor, EPKept]:
    """(out (L, D), the most rows any destination needed (capacity mode; 0 in exact mode), what backward keeps):
    the forward body. The experts run as the op's forward body on the received rows, group by group (plan.Group),
    with unit weights: their rows go back as Y itself and the sender combines them with its router weights, as on
    one GPU. With several groups each group's GEMMs run while the next group's rows arrive and the previous
    group's go back."""
    group, key = resolve_group(o.group_name), o.key
    x = inputs.x
    plan = make_plan(inputs.routing, dist.get_world_size(group), group, o.capacity, o.fail_on_overflow, o.chunks,
                     o.agreed)
    sending = plan.send(x)
    recv_x, arrived = plan.dispatch_groups(sending)
    ones = recv_x.new_ones(recv_x.shape[0], 1, dtype=torch.float32)
    ret, kept, back = plan.return_buffer(recv_x), [], []
    for g, handle in zip(plan.groups, arrived):
        wait([handle])
        if g is plan.groups[-1]:
            del sending  # every group's rows have left (held until then: the all-to-alls read it)
        y, k = experts_forward(_group_inputs(recv_x, ones, inputs, g), key)
        kept.append(k)
        back.append((plan.give_back_group(y, g, ret), y))  # y lives until its rows are back
    wait(h for h, _ in back)
    del back
    out = plan.combine(ret, inputs.topk_w.float().contiguous(), x.dtype) if x.shape[0] else torch.zeros_like(x)
    rows = recv_x if _keeps_rows(key) else x.new_empty(0)
    return out, plan.needed, EPKept(plan.tensors(), rows, tuple(kept))


def _joined(parts: list[torch.Tensor], like: torch.Tensor | None, groups) -> torch.Tensor:
    """The groups' gradients of a weight, one tensor in the weight's layout (one group: its own)."""
    if len(parts) == 1 or like is None:
        return parts[0]
    out = torch.empty_strided(like.shape, like.stride(), dtype=parts[0].dtype, device=parts[0].device)
    for g, p in zip(groups, parts):
        out[g.experts].copy_(p)
    return out


def ep_backward(dout: torch.Tensor, inputs: EPInputs, saved: EPKept, o: EPOptions) -> tuple[torch.Tensor, ...]:
    """(dx, dtopk_w, dw1, dw2, dw1_up (empty without w1_up)): the backward body. dy's rows and the router weights go
    to the experts, which run the op's backward body on them group by group (the weights applied in its epilogue,
    as on one GPU) and return dX~ and dS; with several groups, a group's rows go back under the next group's
    GEMMs."""
    if dout.is_cuda:  # autograd runs backward on a thread of its own (see experts.op)
        ensure_context(dout.get_device())
    x, topk_w, key = inputs.x, inputs.topk_w, o.key
    plan = restore_plan(inputs.routing, resolve_group(o.group_name), saved.plan)
    recv_x = saved.recv_x if _keeps_rows(key) else plan.dispatch(plan.send(x))  # "recompute": sent again
    w_rows = in_row_order(topk_w, plan.routing.token_slot, plan.routing.expert_token_idx.shape[0],
                          torch.float32)  # router weights in expert order
    w_recv = plan.dispatch(plan.in_send_order(w_rows)).view(-1, 1)
    sending = plan.send(dout)
    dy_recv, arrived = plan.dispatch_groups(sending)
    dx_ret = ds_ret = None
    grads, back = [], []
    for g, handle, kept in zip(plan.groups, arrived, saved.ops):
        wait([handle])
        if g is plan.groups[-1]:
            del sending
        dx_recv, dw1, dw2, ds_recv, _db1, _db2, dw1_up = experts_backward(
            part(dy_recv, g.rows), _group_inputs(recv_x, w_recv, inputs, g), kept, key)
        if dx_ret is None:
            dx_ret, ds_ret = plan.return_buffer(dx_recv), plan.return_buffer(ds_recv.view(-1))
        back += [(plan.give_back_group(dx_recv, g, dx_ret), dx_recv),
                 (plan.give_back_group(ds_recv.view(-1), g, ds_ret), ds_recv)]
        grads.append((dw1, dw2, dw1_up))
    wait(h for h, _ in back)
    del back, dy_recv, recv_x
    dw1, dw2, dw1_up = (_joined(list(p), like, plan.groups)
                        for p, like in zip(zip(*grads), (inputs.w1, inputs.w2, inputs.w1_up)))
    dx = plan.combine(dx_ret, None, x.dtype) if x.shape[0] else torch.zeros_like(x)
    slot = plan.slot_LK.long()
    dtopk_w = (ds_ret[slot.clamp(max=max(ds_ret.shape[0] - 1, 0))] if ds_ret.numel() else
               ds_ret.new_zeros(slot.shape))
    dtopk_w = dtopk_w.masked_fill(slot >= plan.kept, 0).to(topk_w.dtype)
    return dx, dtopk_w, dw1, dw2, dw1_up


# One custom-op pair for both dispatch modes, its schemas from the bundles above: torch.compile traces it
# (capacity dispatch: fixed shapes, ep·C rows, so it compiles with fullgraph=True and runs in a CUDA graph; the
# communication inside it, on a process group named by string), and eager mode calls its bodies directly
# (distributed.ep_op, declared as moeblaze.declare.Op, as the experts op is).
def _forward_fake(inputs: EPInputs, o: EPOptions):
    group_name, key, capacity = o.group_name, o.key, o.capacity
    if capacity is None:
        raise NotImplementedError("exact dispatch under torch.compile: its row counts are read on the host")
    x, E_loc = inputs.x, inputs.w1.shape[0]
    R, dev = dist.get_world_size(resolve_group(group_name)) * capacity, x.device
    ints = dict(dtype=torch.int32, device=dev)
    recv = OpInputs(x.new_empty(R, x.shape[1]), inputs.w1, inputs.w2, x.new_empty(R, 1, dtype=torch.float32),
                    torch.empty(E_loc, **ints), torch.empty(E_loc + 1, **ints), torch.empty(R, **ints),
                    torch.empty(R, 1, **ints), w1_up=inputs.w1_up)
    longs = dict(dtype=torch.int64, device=dev)
    plan = PlanTensors(recv.expert_counts, recv.expert_offsets, recv.expert_token_idx, recv.token_slot,
                       send_pos=torch.empty(R, **longs), slot_LK=torch.empty(inputs.token_slot.shape, **ints),
                       kept_rows=torch.empty(1, **ints), splits=torch.empty(0, **longs))
    rows = recv.x if _keeps_rows(key) else x.new_empty(0)
    return x.new_empty(x.shape), torch.empty((), **longs), EPKept(plan, rows, (kept_like(recv, key),))


EP = declare_ep_op("ep", EPInputs, EPKept, ep_forward, ep_backward, _forward_fake)


def first_exchange(ep: int, E_loc: int, capacity: int | None) -> tuple[int, ...]:
    """The shape of this transport's first exchange (stops.refuse): the per-expert counts, and capacity dispatch's
    capacity."""
    return (ep, E_loc) if capacity is None else (ep, E_loc + 1)


def rows_sent(topk_idx: torch.Tensor, E_loc: int, ep: int) -> torch.Tensor:
    """(ep,) int64: the (token, expert) rows this rank's routing sends to each rank."""
    dest = topk_idx.reshape(-1).long() // E_loc
    return torch.zeros(ep, dtype=torch.int64, device=topk_idx.device).scatter_add_(0, dest, torch.ones_like(dest))


def run(call) -> tuple[torch.Tensor, torch.Tensor]:
    """The transport's entry (distributed.transports): (out, needed) for an EPCall. The sender's routing index over
    all E experts is built here (its rows are the send order)."""
    routing = build_routing_index(call.topk_idx, call.num_experts, call.index_method, check=False)
    inputs = EPInputs(call.x, call.topk_w, call.w1, call.w2, *routing.tensors(), call.w1_up)
    return run_ep_op(EP, inputs, call)
