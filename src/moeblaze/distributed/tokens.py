"""The "tokens" transport of expert parallelism: each token crosses once to each rank that holds one of its experts,
the experts there gather it, and one partial sum per (token, rank) comes back: MoEBlaze's zero-buffer dataflow
across ranks (the per-pair transport, distributed.pairs, sends one row per (token, expert) pair: at top-8 over 128
experts 4x the rows at ep = 2, 2.2x at ep = 4).

Sender (every rank, its own L tokens routed to global ids topk_idx (L, K); rank d holds experts [d·E_loc,
(d+1)·E_loc)): the (token, rank) rows in destination-major order, tokens ascending inside each destination; with
each row go its K local expert ids (E_loc where the pair's expert is on another rank: a sentinel) and its K router
weights, in the pair's own column k, as one (S, 2K) float32 block (the ids exact: E_loc < 2^24). Exact dispatch
sends S = the rows routed (split sizes read on the host once per layer call, as the per-pair transport); capacity
dispatch C rows per (source, destination) pair, a destination's tokens past C dropped (all their pairs there),
padding rows all sentinels.
Receiver: the R rows that arrive and their ids form an ordinary top-K routing with sentinels over the E_loc local
experts (routing.index, sort-free); the op (experts.op) runs on it as on one GPU, router weights and all, so its
combine returns one partial sum per row, the sum of that token's experts here. They go back; the sender adds each
token's partial sums (stages.combine_slots over each rank's first pair: no atomics, a fixed order).
Backward mirrors it: dy crosses once per (token, rank), the op's backward returns dX~'s partial sums per row and dS
per pair (column k of the row), which go back; dx is the sender's sum of the partial sums, and the router weights'
gradient a gather. Under checkpoint="recompute" the rows cross again in backward, once. The results equal one GPU
within the op's rounding (the partial sums round to x's dtype before they are added), not bit for bit: the per-pair
transport is the bitwise reference. EPConfig(wire="e4m3"): the rows of x and of dy cross as e4m3 with their
1 x 128 float32 scales (experts.quant, one pass each side) and are dequantized into the receive buffer as each part
arrives; the partial sums return in x's dtype. The op then runs on those rows as they arrived.
Autograd: its own custom-op pair, moeblaze::ep_tokens_fwd / _bwd (distributed.ep_op), schemas and fakes
from TokenInputs and TokenKept; torch.compile traces it under capacity dispatch (fixed shapes).

Memory kept per layer: the plan, O(S + L·K + R·K) int32 (send tokens, each pair's row and combine slot, the
receiver's index and its router weights in float32); under checkpoint="preact" the received rows R·D (R <= the
per-pair transport's rows) and the pre-activation (pairs·F); under "recompute" neither. Transient: the send and
return buffers, S·D each (under wire="e4m3" also their e4m3 rows and scales, S·D bytes and R·D bytes).

Legend: ep ranks, E_loc experts a rank, L tokens and K experts per token on this rank, S rows sent, R received, D
hidden.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..experts.op import Kept, OpInputs, experts_backward, experts_forward, kept_like, parse
from ..experts.quant import dequantize_rows, quantize_rows
from ..experts.stages import combine_slots
from ..launch import ensure_context
from ..reference.fp8 import FP8
from ..routing import RoutingIndex, build_routing_index
from .ep_op import EPOptions, declare_ep_op, run_ep_op
from .plan import _all_to_all, capacity_checks, resolve_group, wait
from .stops import exchange, stop_if_any


class TokenInputs(NamedTuple):
    """The op's tensor inputs: x (L, D), the router weights (L, K), this rank's experts w1 (E_loc, F, D) (the gate
    rows where w1_up holds the up rows apart) and w2 (E_loc, D, H), the global expert ids (L, K)."""
    x: torch.Tensor
    topk_w: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_idx: torch.Tensor
    w1_up: torch.Tensor | None = None


class TokenPlanTensors(NamedTuple):
    """The plan as backward gets it back: the sender's send_tok (S,) (each sent row's token), row_LK (L, K) (each
    pair's row, S where dropped), slot_LK (L, K) (the row where this pair is its rank's first, else S), kept (1,)
    = S, splits (2, ep) on the host (empty: capacity dispatch); the receiver's index over its R rows (with
    sentinels) and their router weights recv_w (R, K) float32."""
    send_tok: torch.Tensor
    row_LK: torch.Tensor
    slot_LK: torch.Tensor
    kept: torch.Tensor
    splits: torch.Tensor
    recv_counts: torch.Tensor
    recv_offsets: torch.Tensor
    recv_token_idx: torch.Tensor
    recv_slot: torch.Tensor
    recv_w: torch.Tensor


class TokenKept(NamedTuple):
    """What forward hands backward: the plan, the received rows (empty under "recompute": sent again) and the op's
    own Kept, one per part (through the custom ops flat; their schemas name one part: the traced path has one)."""
    plan: TokenPlanTensors
    recv_x: torch.Tensor
    ops: tuple[Kept, ...]


def first_exchange(ep: int, E_loc: int, capacity: int | None) -> tuple[int, ...]:
    """The shape of this transport's first exchange (stops.refuse): the counts, and capacity dispatch's capacity."""
    return (ep,) if capacity is None else (ep, 2)


def rows_sent(topk_idx: torch.Tensor, E_loc: int, ep: int) -> torch.Tensor:
    """(ep,) int64: the (token, rank) rows this rank's routing sends to each rank (what capacity dispatch bounds)."""
    return _hits(topk_idx.long() // E_loc, ep).sum(0)


def _blocks(splits: list[list[int]]) -> list[slice]:
    """Each part's block of a part-major buffer, from the parts' split sizes."""
    out, at = [], 0
    for sizes in splits:
        out.append(slice(at, at + sum(sizes)))
        at += sum(sizes)
    return out


def _hits(dest: torch.Tensor, ep: int) -> torch.Tensor:
    """(L, ep) int64: 1 where token t has an expert on rank d (dest (L, K): each pair's rank)."""
    return torch.zeros(dest.shape[0], ep, dtype=torch.int64, device=dest.device).scatter_(1, dest, 1)


class TokenPlan:
    """One forward call's transport: which (token, rank) rows go where, what arrives, where each pair's gradient
    comes back (the module header). Built by communicating (the counts; in exact mode one host read), restored in
    backward from its tensors without communicating."""

    def __init__(self, topk_idx: torch.Tensor, topk_w: torch.Tensor, E_loc: int, group, capacity: int | None,
                 fail_on_overflow: bool, parts: int = 1, agreed: int = 0):
        self.group, self.parts = group, parts
        ep = dist.get_world_size(group)
        L, K = topk_idx.shape
        dev = topk_idx.device
        dest = topk_idx.long() // E_loc
        hit = _hits(dest, ep)
        counts = hit.sum(0)  # (ep,) rows for each destination
        within = hit.cumsum(0) - hit  # each (token, destination)'s place among that destination's rows
        self.needed = counts.max() if L else counts.new_zeros(())
        if capacity is None:
            got, stops = exchange(counts, group, agreed)
            host = torch.stack([counts, got, stops]).cpu()  # the one host sync
            stop_if_any(host[2])
            self.splits = host[:2]  # (2, ep)
            block = counts  # each destination's rows
            keep = hit.bool()
        else:
            sent = torch.stack([counts.clamp(max=capacity), counts.new_full((ep,), capacity)], 1)
            got, stops = exchange(sent, group, agreed)
            capacity_checks(got[:, 1] != capacity, self.needed, capacity, fail_on_overflow, group, stops)
            self.splits = torch.empty(0, dtype=torch.int64, device=dev)
            block = counts.new_full((ep,), capacity)
            keep = hit.bool() & (within < capacity)
        self._sizes(None if capacity is None else capacity)
        # the send buffer part-major: part p holds sub-block p of every destination's block (its rows
        # [p·n / P, (p + 1)·n / P), n the block's rows), destination after destination
        bounds = torch.arange(parts + 1, device=dev)[:, None] * block[None, :] // parts  # (P + 1, ep)
        size = (bounds[1:] - bounds[:-1]).flatten()
        base = (size.cumsum(0) - size).view(parts, ep)
        part = ((within + 1) * parts - 1).div(block.clamp(min=1), rounding_mode="floor").clamp(0, parts - 1)
        d = torch.arange(ep, device=dev).expand(L, ep)
        base = base[part, d] + within - bounds[part, d]
        S = self.sent
        row_Ld = torch.where(keep, base, S)  # (L, ep): each (token, destination)'s send row, S: none
        self.row_LK = row_Ld.gather(1, dest)
        # the combine adds each rank's partial sum once: at the pair that is the first of its row's rank
        k = torch.arange(K, device=dev)
        earlier = (dest[:, :, None] == dest[:, None, :]) & (k[None, :] < k[:, None])
        self.slot_LK = torch.where(earlier.any(2), S, self.row_LK).int()
        self.kept = torch.full((1,), S, dtype=torch.int32, device=dev)
        tokens = torch.arange(L, device=dev)[:, None].expand(L, ep)
        self.send_tok = torch.zeros(S + 1, dtype=torch.int64, device=dev).scatter_(0, row_Ld.flatten(),
                                                                                tokens.flatten())[:S]
        # each sent row's K local ids (E_loc: the pair is elsewhere or dropped) and router weights, column k for
        # pair k, one float32 block; a dropped pair's entries land in row S, cut off
        ids = torch.full((S + 1, K), E_loc, dtype=torch.int32, device=dev)
        weights = torch.zeros(S + 1, K, dtype=torch.float32, device=dev)
        cols = k.expand(L, K)
        ids[self.row_LK, cols] = (topk_idx.long() % E_loc).int()
        weights[self.row_LK, cols] = topk_w.float()
        self.meta = torch.cat([ids[:S].float(), weights[:S]], 1)  # ids < 2^24: exact in float32
        self.row_LK = self.row_LK.int()

    def _sizes(self, capacity: int | None) -> None:
        """The rows sent and received, each part's split sizes and its blocks of the send and receive buffers: from
        the host's splits (exact), or capacity dispatch's C rows per destination in equal splits."""
        ep, P = dist.get_world_size(self.group), self.parts
        if self.splits.numel():
            n_in, n_out = self.splits.tolist()
        else:
            n_in = n_out = [capacity] * ep
        cut = (lambda n, p: [(p + 1) * c // P - p * c // P for c in n])
        self.in_splits = [cut(n_in, p) for p in range(P)]
        self.out_splits = [cut(n_out, p) for p in range(P)]
        self.send_blocks, self.recv_blocks = _blocks(self.in_splits), _blocks(self.out_splits)
        self.sent, self.received = sum(n_in), sum(n_out)
        if not self.splits.numel():
            self.in_splits = self.out_splits = [None] * P  # equal splits

    def receive_index(self, recv_meta: torch.Tensor, E_loc: int) -> tuple[RoutingIndex, torch.Tensor]:
        """The receiver's routing index over its R rows (their ids, sentinels dropped) and their router weights."""
        K = recv_meta.shape[1] // 2
        ids, weights = recv_meta[:, :K].int(), recv_meta[:, K:].contiguous()
        return build_routing_index(ids, E_loc, check=False, sentinels=True), weights

    def tensors(self, recvs: list[RoutingIndex], recv_w: torch.Tensor) -> TokenPlanTensors:
        """The plan's tensors, the parts' receiver indexes one after another."""
        idx = [r.tensors() for r in recvs]
        joined = idx[0] if len(idx) == 1 else tuple(torch.cat(ts) for ts in zip(*idx))
        return TokenPlanTensors(self.send_tok, self.row_LK, self.slot_LK, self.kept, self.splits, *joined, recv_w)

    @classmethod
    def restore(cls, group, saved: TokenPlanTensors) -> tuple[TokenPlan, list[RoutingIndex]]:
        plan = cls.__new__(cls)
        plan.group, plan.needed, plan.splits = group, None, saved.splits
        plan.parts = saved.recv_offsets.shape[0] - saved.recv_counts.shape[0]  # (E_loc + 1) a part against E_loc
        plan.send_tok, plan.row_LK, plan.slot_LK, plan.kept = saved.send_tok, saved.row_LK, saved.slot_LK, saved.kept
        plan._sizes(saved.send_tok.shape[0] // dist.get_world_size(group))
        E_loc, K = saved.recv_counts.shape[0] // plan.parts, saved.recv_slot.shape[1]
        rows = [b.stop - b.start for b in plan.recv_blocks]
        sizes = ([E_loc] * plan.parts, [E_loc + 1] * plan.parts, [r * K for r in rows], rows)
        recvs = [RoutingIndex(*ts, dropped=True) for ts in zip(*(t.split(n) for t, n in zip(
            (saved.recv_counts, saved.recv_offsets, saved.recv_token_idx, saved.recv_slot), sizes)))]
        return plan, recvs

    def send(self, rows_LD: torch.Tensor) -> torch.Tensor:
        """The send buffer of rows_LD (x or dy): each (token, rank) row once."""
        if rows_LD.shape[0] == 0:  # no tokens here (capacity dispatch still sends its padding)
            return rows_LD.new_zeros((self.sent,) + tuple(rows_LD.shape[1:]))
        return rows_LD[self.send_tok]

    def dispatch_parts(self, rows: torch.Tensor, wire: str = "native") -> tuple[torch.Tensor, list]:
        """A send buffer's rows to their ranks, part by part, each all-to-all issued without waiting where there
        are several parts: the receive buffer and a handle per part (wait on it before reading its block; keep
        rows until then). wire="e4m3": the rows cross as quantize_rows's (e4m3, 1 x 128 scales) and a part's
        handle dequantizes its block into the receive buffer, in rows' dtype, when waited on."""
        if wire == "e4m3":
            q, scales = quantize_rows(rows)
            q_out, q_handles = self.dispatch_parts(q.view(torch.uint8))
            s_out, s_handles = self.dispatch_parts(scales)
            out = rows.new_empty((self.received, rows.shape[1]))
            return out, [_Dequantized(q_out[b], s_out[b], out[b], (hq, hs), (q, scales))
                         for b, hq, hs in zip(self.recv_blocks, q_handles, s_handles)]
        out = rows.new_empty((self.received,) + tuple(rows.shape[1:]))
        later = self.parts > 1
        return out, [_all_to_all(out[r], rows[s], o, i, self.group, later)
                     for r, s, i, o in zip(self.recv_blocks, self.send_blocks, self.in_splits, self.out_splits)]

    def dispatch(self, rows: torch.Tensor, wire: str = "native") -> torch.Tensor:
        out, handles = self.dispatch_parts(rows, wire)
        wait(handles)
        return out

    def give_back_part(self, rows: torch.Tensor, p: int, into: torch.Tensor):
        """Part p's received rows back to their senders, into its block of the return buffer `into`: a handle
        (keep rows until it is waited on) or None."""
        return _all_to_all(into[self.send_blocks[p]], rows, self.in_splits[p], self.out_splits[p], self.group,
                           self.parts > 1)

    def combine(self, rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Each token's partial sums added, one per rank it reached (fp32, a fixed order)."""
        return combine_slots(rows, self.slot_LK, None, self.kept, out_dtype)

    def pair_values(self, rows_SK: torch.Tensor) -> torch.Tensor:
        """(L, K): each pair's value from its row's column k (0 where the pair was dropped)."""
        S = rows_SK.shape[0]
        padded = torch.cat([rows_SK, rows_SK.new_zeros(1, rows_SK.shape[1])])
        k = torch.arange(self.row_LK.shape[1], device=rows_SK.device)
        return padded[self.row_LK.long().clamp(max=S), k.expand_as(self.row_LK)]


class _Dequantized:
    """A part of e4m3 rows on its way (EPConfig.wire="e4m3"): wait() waits on its all-to-alls (handles), then
    writes q · scales into the receive buffer's block; keep: the send buffers, alive until then."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, handles, keep):
        self.q, self.scales, self.out, self.handles, self.keep = q, scales, out, handles, keep

    def wait(self) -> None:
        wait(self.handles)
        dequantize_rows(self.q.view(FP8), self.scales, self.out.dtype, out=self.out)
        self.keep = ()


def _op_inputs(rows: torch.Tensor, recv_w: torch.Tensor, recv: RoutingIndex, inputs: TokenInputs) -> OpInputs:
    return OpInputs.of(rows, inputs.w1, inputs.w2, recv_w, recv, w1_up=inputs.w1_up)


def tokens_forward(inputs: TokenInputs, o: EPOptions) -> tuple[torch.Tensor, torch.Tensor, TokenKept]:
    """(out (L, D), the most rows any destination needed (capacity dispatch's tracker), what backward keeps). With
    several parts, part p's experts run while part p + 1's rows arrive and part p - 1's partial sums go back."""
    group, key = resolve_group(o.group_name), o.key
    x, E_loc = inputs.x, inputs.w1.shape[0]
    plan = TokenPlan(inputs.topk_idx, inputs.topk_w, E_loc, group, o.capacity, o.fail_on_overflow, o.chunks,
                     o.agreed)
    meta, meta_arrived = plan.dispatch_parts(plan.meta)
    sending = plan.send(x)
    recv_x, arrived = plan.dispatch_parts(sending, o.wire)
    ret = x.new_empty((plan.sent, x.shape[1]))
    recvs, weights, kept, back = [], [], [], []
    for p, block in enumerate(plan.recv_blocks):
        wait([meta_arrived[p], arrived[p]])
        recv, recv_w = plan.receive_index(meta[block], E_loc)
        partial, k = experts_forward(_op_inputs(recv_x[block], recv_w, recv, inputs), key)
        recvs.append(recv), weights.append(recv_w), kept.append(k)
        back.append((plan.give_back_part(partial, p, ret), partial))  # every rank takes part, one without tokens too
    wait(h for h, _ in back)
    del back, sending, plan.meta
    out = plan.combine(ret, x.dtype) if x.shape[0] else torch.zeros_like(x)
    rows = recv_x if parse(key).checkpoint != "recompute" else x.new_empty(0)
    return out, plan.needed.to(torch.int64), TokenKept(plan.tensors(recvs, torch.cat(weights)), rows, tuple(kept))


def tokens_backward(dout: torch.Tensor, inputs: TokenInputs, saved: TokenKept, o: EPOptions
                    ) -> tuple[torch.Tensor, ...]:
    """(dx, dtopk_w, dw1, dw2, dw1_up (empty without w1_up)). With several parts, part p's backward GEMMs run while
    part p + 1's dy arrives and part p - 1's dX partial sums and dS go back; the weights' gradients are the parts'
    sum."""
    if dout.is_cuda:  # autograd runs backward on a thread of its own (see experts.op)
        ensure_context(dout.get_device())
    x, topk_w = inputs.x, inputs.topk_w
    key = o.key
    plan, recvs = TokenPlan.restore(resolve_group(o.group_name), saved.plan)
    recv_x = saved.recv_x if parse(key).checkpoint != "recompute" else plan.dispatch(plan.send(x), o.wire)
    sending = plan.send(dout)
    dy_recv, arrived = plan.dispatch_parts(sending, o.wire)
    dx_ret = dout.new_empty((plan.sent, dout.shape[1]))
    ds_ret = torch.empty(plan.sent, topk_w.shape[1], dtype=torch.float32, device=dout.device)
    dw, back = None, []
    for p, (block, recv, kept) in enumerate(zip(plan.recv_blocks, recvs, saved.ops)):
        wait([arrived[p]])
        dx_recv, dw1, dw2, ds_recv, _db1, _db2, dw1_up = experts_backward(
            dy_recv[block], _op_inputs(recv_x[block], saved.plan.recv_w[block], recv, inputs), kept, key)
        ds_recv = ds_recv.float()
        back += [(plan.give_back_part(dx_recv, p, dx_ret), dx_recv), (plan.give_back_part(ds_recv, p, ds_ret), ds_recv)]
        dw = (dw1, dw2, dw1_up) if dw is None else tuple(a.add_(b) for a, b in zip(dw, (dw1, dw2, dw1_up)))
    wait(h for h, _ in back)
    del back, dy_recv, recv_x, sending
    dx = plan.combine(dx_ret, x.dtype) if x.shape[0] else torch.zeros_like(x)
    dtopk_w = plan.pair_values(ds_ret).to(topk_w.dtype)
    return dx, dtopk_w, *dw


def _forward_fake(inputs: TokenInputs, o: EPOptions):
    group_name, key, capacity = o.group_name, o.key, o.capacity
    if capacity is None:
        raise NotImplementedError("exact dispatch under torch.compile: its row counts are read on the host")
    x, (L, K), E_loc = inputs.x, inputs.topk_idx.shape, inputs.w1.shape[0]
    R, dev = dist.get_world_size(resolve_group(group_name)) * capacity, x.device
    ints, longs = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
    recv_w = torch.empty(R, K, dtype=torch.float32, device=dev)
    recv = OpInputs(x.new_empty(R, x.shape[1]), inputs.w1, inputs.w2, recv_w, torch.empty(E_loc, **ints),
                    torch.empty(E_loc + 1, **ints), torch.empty(R * K, **ints), torch.empty(R, K, **ints),
                    w1_up=inputs.w1_up)
    plan = TokenPlanTensors(torch.empty(R, **longs), torch.empty(L, K, **ints), torch.empty(L, K, **ints),
                            torch.empty(1, **ints), torch.empty(0, **longs), *recv.routing.tensors(), recv_w)
    rows = recv.x if parse(key).checkpoint != "recompute" else x.new_empty(0)
    return x.new_empty(x.shape), torch.empty((), **longs), TokenKept(plan, rows, (kept_like(recv, key),))


EP_TOKENS = declare_ep_op("ep_tokens", TokenInputs, TokenKept, tokens_forward, tokens_backward, _forward_fake)


def run(call) -> tuple[torch.Tensor, torch.Tensor]:
    """The transport's entry (distributed.transports): (out, needed) for an EPCall."""
    if call.chunks > 1 and torch.compiler.is_compiling():
        raise ValueError(f"EPConfig(chunks={call.chunks}) pipelines the tokens transport eagerly; under torch.compile "
                         "use chunks=1 (the traced op is one part)")
    inputs = TokenInputs(call.x, call.topk_w, call.w1, call.w2, call.topk_idx, call.w1_up)
    return run_ep_op(EP_TOKENS, inputs, call)
