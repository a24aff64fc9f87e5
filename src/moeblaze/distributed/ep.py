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

exact dispatch: variable split sizes, read on the host once per layer call (one device-to-host sync; backward
reuses them). Memory kept per layer, beyond the routing indexes (O(L·K + R) int32) and the tile schedule: under
checkpoint="preact" the received rows R·D and the pre-activation R·F; under "recompute" nothing more: the rows are
sent again in backward and the pre-activation recomputed. Transient: the send and return buffers (L·K·D each).

Legend: ep ranks, E experts (E_loc = E / ep per rank), L tokens and K experts per token on this rank, R rows
received, D hidden, F rows of W1 per expert.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..experts import CHECKPOINTS, check_backend
from ..experts.autograd import experts_backward, experts_forward
from ..experts.dispatch import resolve
from ..experts.stages import RowPlan, combine
from ..reference import check_activation
from ..routing import RoutingIndex, build_routing_index, check_expert_inputs, check_topk_weights


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


def _all_to_all(t: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """t's rows split by in_splits to the ranks of group; the rows received from each, concatenated."""
    out = t.new_empty((sum(out_splits),) + tuple(t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
    return out


class _Plan:
    """One EP layer call's routing on both sides: the sender's index and row plan, the split sizes, the
    receiver's index."""

    def __init__(self, routing: RoutingIndex, ep: int, group):
        self.routing, self.group = routing, group
        E = routing.num_experts
        self.send_counts = routing.expert_counts.view(ep, E // ep)
        recv_counts = torch.empty_like(self.send_counts)
        dist.all_to_all_single(recv_counts, self.send_counts.contiguous(), group=group)
        both = torch.stack([self.send_counts.sum(1), recv_counts.sum(1)]).cpu()  # the one host sync
        self.in_splits, self.out_splits = both[0].tolist(), both[1].tolist()
        self.recv = receiver_index(recv_counts)
        self.sender = RowPlan(routing.expert_token_idx, routing.expert_offsets, routing.token_slot,
                              *RowPlan.build(routing).sched)

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        return _all_to_all(rows, self.out_splits, self.in_splits, self.group)

    def give_back(self, rows: torch.Tensor) -> torch.Tensor:
        return _all_to_all(rows, self.in_splits, self.out_splits, self.group)


class _EPExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_w, w1, w2, plan: _Plan, activation: str, save: bool, backend: str):
        r = plan.recv
        recv_x = plan.dispatch(x[plan.routing.expert_token_idx.long()])
        ones = recv_x.new_ones(recv_x.shape[0], 1, dtype=torch.float32)
        y, preact, *sched = experts_forward(recv_x, w1, w2, ones, None, None, *r.tensors(), activation, save,
                                            backend)
        ret = plan.give_back(y)
        del y
        out = (combine(plan.sender, ret, topk_w.float().contiguous(), x.dtype) if x.shape[0] else torch.zeros_like(x))
        ctx.plan, ctx.activation, ctx.save, ctx.backend = plan, activation, save, backend
        ctx.save_for_backward(x, topk_w, w1, w2, recv_x if save else x.new_empty(0), preact, *sched)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, topk_w, w1, w2, recv_x, preact, *sched = ctx.saved_tensors
        plan, r = ctx.plan, ctx.plan.recv
        eti = plan.routing.expert_token_idx.long()
        if not ctx.save:  # "recompute": the rows are sent again
            recv_x = plan.dispatch(x[eti])
        dy_recv = plan.dispatch(dout.contiguous()[eti])
        w_rows = torch.empty(eti.shape[0], dtype=torch.float32, device=x.device)  # router weights in row order
        w_rows[plan.routing.token_slot.reshape(-1).long()] = topk_w.reshape(-1).float()
        w_recv = plan.dispatch(w_rows).view(-1, 1)
        dx_recv, dw1, dw2, ds_recv, _, _ = experts_backward(
            dy_recv, recv_x, w1, w2, w_recv, None, None, *sched, r.expert_offsets, r.expert_token_idx, r.token_slot,
            preact, ctx.activation, ctx.save, ctx.backend)
        del dy_recv, recv_x
        dx_ret = plan.give_back(dx_recv)
        ds_ret = plan.give_back(ds_recv.view(-1))
        dx = combine(plan.sender, dx_ret, None, x.dtype) if x.shape[0] else torch.zeros_like(x)
        dtopk_w = ds_ret[plan.routing.token_slot.long()].to(topk_w.dtype)
        return dx, dtopk_w, dw1, dw2, None, None, None, None


def ep_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w1_local: torch.Tensor,
               w2_local: torch.Tensor, group=None, activation: str = "swiglu", checkpoint: str = "preact",
               backend: str = "auto", index_method: str = "auto") -> torch.Tensor:
    """The experts' combined output (L, D) for this rank's tokens x (L, D), routed to global expert ids topk_idx
    (L, K) with weights (L, K), over the experts sharded across `group` (default: the world): this rank holds
    experts [rank · E_loc, (rank + 1) · E_loc) as w1_local (E_loc, F, D) and w2_local (E_loc, D, H). Every rank of
    the group must call it (a rank without tokens passes L = 0). Differentiable in x, topk_weights and the local
    weights. The Triton kernels run the experts (impl "triton": a GPU, or the interpreter on the CPU)."""
    check_activation(activation)
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {checkpoint!r}")
    check_backend(backend)
    ep = dist.get_world_size(group)
    E = w1_local.shape[0] * ep
    check_expert_inputs(x, w1_local, w2_local, activation)
    routing = build_routing_index(topk_idx, E, index_method)
    check_topk_weights(topk_weights, routing.token_slot)
    plan = _Plan(routing, ep, group)
    return _EPExperts.apply(x, topk_weights, w1_local, w2_local, plan, activation, checkpoint == "preact",
                            resolve(backend, x.device))
