"""The fused, zero-buffer expert computation as one autograd op: a torch.library custom-op pair (what
torch.compile traces) and an autograd.Function over the same bodies (eager mode). The forward and backward bodies
are written once over a GEMM strategy (NATIVE: experts.stages in the inputs' dtype; experts.fp8.Fp8Gemms: the
four data GEMMs on e4m3), chosen by the op's OpKey, with everything else (the tile schedule, the combines, the
activation's backward, the bias gradients, dropped pairs, the checkpoint policy) shared. Expert parallelism calls
the same bodies on the rows it receives (distributed.ep).

Forward (3 launches + the tile schedule, one launch, reused by backward):
  up       A = act(x[expert_token_idx] @ W1[e]ᵀ + b1[e])  gather in the load, bias and activation in the epilogue
  down     Y = A @ W2[e]ᵀ                           (R, D), transient
  combine  out[t] = sum_k w[t,k] (Y[token_slot[t,k]] + b2[e])  fp32, no atomics
Backward (5 launches, +1 with checkpoint="recompute", +1 on Gluon where down_bwd is two):
  [up      preact = x[expert_token_idx] @ W1[e]ᵀ     only under "recompute"]
  down_bwd dA' = dy[expert_token_idx] @ W2[e]; epilogue: A from preact, dS = <dA', A>, dH, s·A
  dW2      dy[expert_token_idx]ᵀ @ (s·A)             per expert, reduction over its rows
  dX~      dH @ W1[e]                                (R, D), transient
  dx       dx[t] = sum_k dX~[token_slot[t,k]]         fp32, no atomics
  dW1      dHᵀ @ x[expert_token_idx]                 per expert, its buffer made once dX~ is gone
  [biases  dB1, dB2 per expert; dS += <dy, b2[e]>     only with biases (stages.bias_grads)]
Layouts: W1 and W2 by strides (transposed views, as gpt-oss stores them, are read in place, and their gradients
are written in the same layout); gate/up rows of W1 in halves or interleaved, preact's columns in W1's order.
W1 in two parts (w1_up: the up rows apart, as torchtitan stores w1 and w3): the Gluon kernels read them in place
(two descriptors: up, the recomputed up, dX~'s K loop switching at the gate rows' end) and write dW1's tiles into
each part (dX~ where the gate rows are a multiple of 64, dW1 of 128); tl and FP8 concatenate them per call (a
transient of W1's size, never kept) and tl's dW1 is copied out of a whole one.

Memory contract (bytes kept from forward to backward, beyond x, the weights and topk_weights, which exist
anyway; b = bytes per element of x's dtype):
  checkpoint="preact"     preact: R·F·b + the routing index's token ids, slots and offsets 4·(2·R + E + 1)
                          + the tile schedule 4·(2·(R // 128 + E) + 1)
  checkpoint="preact-fp8" preact in e4m3, R·F + its 1 x 128 scales 4·R·ceil(F / 128), + the same index and
                          schedule (quantized in a pass of its own, experts.quant, not yet in the up kernel's
                          epilogue; read back by the dH pass as it loads it on Hopper, in a pass into dH's
                          buffer before the tl kernel's fused dH)
  checkpoint="recompute"  the routing index and the tile schedule only; preact is recomputed in backward
                          (one more GEMM)
Never kept: any (R, D) gathered copy of x or dy, A = act(preact), Y, dY. Transient in forward: A and Y; in
backward: preact (recompute; dH is then written over it), dH, s·A, dX~. The peak of backward: dW2, dX~ (R·D·b)
or dW1, with dH and the incoming gradient; dH takes preact's buffer (written over it) under "recompute", and
under "preact" in eager mode where the graph is not kept for another backward (the kept preact has no reader
after dH; through torch.compile's custom op, or with retain_graph, dH gets a buffer of its own).
Under precision="fp8" the weights may be float32 masters of a half-precision x (experts.autocast_weights): an e4m3
call quantizes them where they lie (no half-precision copy made or kept), and the weight-gradient kernels store
their gradients in float32 from their float32 sums (no half-precision gradient, no cast pass).
moe_experts(chunk_tokens=...) bounds every transient by a token chunk. No host synchronization anywhere: tile
counts are bounded by R // BLOCK_M + E and unused tiles exit at once. On Gluon, preact goes through the io dtype
before A is computed from it, as backward computes A from the saved preact, and dA' goes through it before dH and
dS are.
Dropped pairs (a routing index built with sentinels, `dropped`): rows past expert_offsets[E] are never computed;
the combines read them as zero, and backward (only for such an index) zeroes their dS and their rows of s·A and dH
before the weight gradients reduce over row blocks.

Host side: every launch that is not autotuned goes through experts.launch (the compiled kernel relaunched
without Triton's per-call dispatch); in eager mode autograd calls the op's bodies directly (EXPERTS.eager),
and torch.compile traces the custom ops. The call's OpKey travels as a short string (OpKey.text), parsed once per value.
The op's inputs are one bundle (OpInputs) and what forward hands backward another (Kept): the custom ops' schemas,
fakes and autograd wiring derive from them, so a new input is one field.

Legend: L tokens, D hidden, H expert intermediate, F rows of W1 per expert, E experts, K top-k, R = L·K.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Protocol

import torch

from ..declare import Op
from ..launch import ensure_context
from ..reference.fp8 import FP8
from ..routing import RoutingIndex
from . import stages
from .fp8 import Fp8Gemms
from .schedule import BLOCK_M, RowPlan, whole_w1
from .quant import quantize_rows


class OpKey(NamedTuple):
    """What one call of the op computes, resolved for its device: ExpertsConfig's choices that reach the kernels
    (backend "tl" or "gluon") and the call's layout (dropped: an index with dropped pairs; interleaved gate/up)."""
    activation: str = "swiglu"
    checkpoint: str = "preact"
    backend: str = "tl"
    fp8: bool = False
    fp8_weight_cache: bool = False
    dropped: bool = False
    interleaved: bool = False

    @property
    def text(self) -> str:
        """The key as the custom ops carry it, a short string (parse inverts it)."""
        return ",".join(v if isinstance(v, str) else str(int(v)) for v in self)

    @property
    def gemms(self) -> Gemms:
        return Fp8Gemms(self) if self.fp8 else NativeGemms(self)


@functools.cache
def parse(key: str) -> OpKey:
    a, c, b, *flags = key.split(",")
    return OpKey(a, c, b, *(f == "1" for f in flags))


class Gemms(Protocol):
    """A GEMM set the op's bodies run on, over one call's RowPlan: NativeGemms (the inputs' dtype) and
    experts.fp8.Fp8Gemms (the four data GEMMs on e4m3). Each is built from the call's OpKey."""

    def up(self, plan: RowPlan, x_LD, inputs: OpInputs, keep: bool) -> tuple:
        """(preact (empty unless keep), act, preact in e4m3 with its scales where the pass made it, else None)."""

    def preact(self, plan: RowPlan, x_LD, inputs: OpInputs) -> torch.Tensor:
        """preact recomputed in backward ("recompute")."""

    def down(self, plan: RowPlan, act_RH, w2_EDH, dtype: torch.dtype) -> torch.Tensor:
        """Y (R, D) in dtype."""

    def dact(self, plan: RowPlan, dy_LD, w2_EDH, preact_RF, preact_scale, topk_w_LK, overwrite: bool) -> tuple:
        """(dH, s·A, dS, dH in e4m3 with its scales where the pass made it, else None)."""

    def dx_rows(self, plan: RowPlan, dpreact_RF, dpreact_q, inputs: OpInputs) -> torch.Tensor:
        """dX~ (R, D)."""


class NativeGemms:
    """The GEMMs in the inputs' dtype, each a stage (experts.stages): SwiGLU in the up GEMM's epilogue, the
    activation's backward in dA''s."""

    def __init__(self, r: OpKey):
        self.r = r

    def up(self, plan: RowPlan, x_LD, inputs: OpInputs, keep: bool):
        """(preact (empty unless keep), act, None: no e4m3 copy of preact made on the way). W1 in two parts is
        read in place where the up kernel takes them (stages.up)."""
        r = self.r
        preact, act = stages.up(plan, x_LD, inputs.w1, r.activation, keep, True, backend=r.backend, b1_EF=inputs.b1,
                                interleaved=r.interleaved, w1_up=inputs.w1_up)
        return preact, act, None

    def preact(self, plan: RowPlan, x_LD, inputs: OpInputs):
        """preact recomputed in backward (W1's parts read in place, as in forward)."""
        r = self.r
        return stages.up(plan, x_LD, inputs.w1, r.activation, True, False, backend=r.backend, b1_EF=inputs.b1,
                         interleaved=r.interleaved, w1_up=inputs.w1_up)[0]

    def down(self, plan: RowPlan, act_RH, w2_EDH, _dtype: torch.dtype):
        return stages.down(plan, act_RH, w2_EDH, self.r.backend)

    def dact(self, plan: RowPlan, dy_LD, w2_EDH, preact_RF, preact_scale, topk_w_LK, overwrite: bool):
        """(dH, s·A, dS, None: no e4m3 dH made on the way). Where preact has no reader after this (overwrite: a
        recomputed preact, or a kept one whose graph is not kept), each dH tile overwrites the preact tile it was
        computed from (read before written, by the same program): no (R, F) buffer. H kept in e4m3 is read back by
        the dH pass itself (stages.down_bwd), and dH gets a buffer of its own, the one a read-back copy would
        take."""
        r = self.r
        dpreact = preact_RF if overwrite else torch.empty(preact_RF.shape, dtype=dy_LD.dtype, device=dy_LD.device)
        act_scaled, dtopk_w = stages.down_bwd(plan, dy_LD, w2_EDH, preact_RF, topk_w_LK, dpreact, r.activation,
                                              backend=r.backend, interleaved=r.interleaved,
                                              preact_scale=preact_scale)
        return dpreact, act_scaled, dtopk_w, None

    def dx_rows(self, plan: RowPlan, dpreact_RF, _dpreact_q, inputs: OpInputs):
        """dX~, W1's parts read in place where the row GEMM takes them (stages.dx_rows)."""
        return stages.dx_rows(plan, dpreact_RF, inputs.w1, self.r.backend, w1_up=inputs.w1_up)


class OpInputs(NamedTuple):
    """The op's tensor inputs, in the custom ops' order: the one definition that the ops' schemas, their fakes, the
    autograd wiring and expert parallelism derive from (a new input is one more field). Optional parts are None.

    x (L, D); w1 (E, F, D), only the gate rows where w1_up is given; w2 (E, D, H); topk_w (L, K); the routing index's
    four arrays (routing.RoutingIndex); b1 (E, F) and b2 (E, D), the biases; w1_up: W1's up rows apart."""
    x: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_w: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    expert_token_idx: torch.Tensor
    token_slot: torch.Tensor
    b1: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    w1_up: torch.Tensor | None = None

    @classmethod
    def of(cls, x, w1, w2, topk_w, routing: RoutingIndex, **optional) -> OpInputs:
        return cls(x, w1, w2, topk_w, *routing.tensors(), **optional)

    @property
    def routing(self) -> RoutingIndex:
        return RoutingIndex(self.expert_counts, self.expert_offsets, self.expert_token_idx, self.token_slot)

    @property
    def whole_w1(self) -> torch.Tensor:
        return whole_w1(self.w1, self.w1_up)

    @property
    def w1_rows(self) -> int:
        """F: W1's rows per expert, both parts."""
        return self.w1.shape[1] + (0 if self.w1_up is None else self.w1_up.shape[1])


DIFFERENTIABLE = ("x", "w1", "w2", "topk_w", "b1", "b2", "w1_up")  # the backward body's outputs, in this order


class Kept(NamedTuple):
    """What forward hands backward beyond its inputs: preact as the checkpoint policy keeps it (x's dtype under
    "preact", e4m3 under "preact-fp8", empty under "recompute"), its 1 x 128 scales (e4m3 only, else empty), and
    the tile schedule (experts.schedule)."""
    preact: torch.Tensor
    preact_scale: torch.Tensor
    tile_expert: torch.Tensor
    tile_row: torch.Tensor
    tiles_used: torch.Tensor

    def plan(self, inputs: OpInputs) -> RowPlan:
        return RowPlan(inputs.expert_token_idx, inputs.expert_offsets, inputs.token_slot, self.tile_expert,
                       self.tile_row, self.tiles_used)


def experts_forward(inputs: OpInputs, key: str) -> tuple[torch.Tensor, Kept]:
    """(out (L, D), what backward keeps): the forward body, the tile schedule built once here and handed to
    backward."""
    r = parse(key)
    x_LD = inputs.x
    plan = RowPlan.build(inputs.routing)
    keep = r.checkpoint != "recompute"
    if x_LD.shape[0] == 0:  # an empty batch (a rank without tokens): no launch can address 0 rows
        preact = x_LD.new_zeros(0, inputs.w1_rows)
        return x_LD.new_zeros(x_LD.shape), Kept(*_kept(preact, None, r), *plan.sched)
    g = r.gemms
    preact, act, preact_q = g.up(plan, x_LD, inputs, keep)
    y_RD = g.down(plan, act, inputs.w2, x_LD.dtype)
    del act
    out = stages.combine(plan, y_RD, inputs.topk_w.float().contiguous(), x_LD.dtype, bias_ED=inputs.b2)
    return out, Kept(*_kept(preact, preact_q, r), *plan.sched)


def _kept(preact_RF: torch.Tensor, preact_q, r: OpKey) -> tuple[torch.Tensor, torch.Tensor]:
    """(preact as backward keeps it, its scales): by the checkpoint policy. Under "preact-fp8", the e4m3 copy the
    up pass made (preact_q) or one made here (a pass of its own)."""
    none = preact_RF.new_empty(0, dtype=torch.float32)
    if r.checkpoint == "recompute":
        return preact_RF.new_empty(0), none
    if r.checkpoint == "preact-fp8":
        return preact_q if preact_q is not None else quantize_rows(preact_RF)
    return preact_RF, none


def kept_like(inputs: OpInputs, key: str) -> Kept:
    """Kept's shapes for these inputs (no data): the fakes' rule, here and in expert parallelism."""
    r, x = parse(key), inputs.x
    R, F = inputs.expert_token_idx.shape[0], inputs.w1_rows
    tiles = R // BLOCK_M + inputs.expert_counts.shape[0]
    ints = dict(dtype=torch.int32, device=x.device)
    fp8 = r.checkpoint == "preact-fp8"
    preact = x.new_empty(R, F, dtype=FP8 if fp8 else x.dtype) if r.checkpoint != "recompute" else x.new_empty(0)
    scale = x.new_empty((R, -(-F // 128)) if fp8 else (0,), dtype=torch.float32)
    return Kept(preact, scale, torch.empty(tiles, **ints), torch.empty(tiles, **ints), torch.empty(1, **ints))


def _forward_fake(inputs: OpInputs, options: OpOptions) -> tuple[torch.Tensor, Kept]:
    return inputs.x.new_empty(inputs.x.shape), kept_like(inputs, options.key)


TAIL_ROWS = 256  # >= the row block (BLOCK_K) of every weight-gradient kernel (experts.tl.configs, gluon_sm90)


def _zero_rows_from(t_RX: torch.Tensor, first: torch.Tensor) -> None:
    """Zero rows [first, first + TAIL_ROWS) of t_RX (those that exist), first a (1,) device tensor: no host sync.
    Past the last row the indices are clamped to it, and every copy of it gets the same value."""
    R = t_RX.shape[0]
    if R == 0:
        return
    rows = (first + torch.arange(TAIL_ROWS, device=t_RX.device)).clamp_(max=R - 1)
    t_RX[rows] = torch.where((rows >= first)[:, None], 0, t_RX[rows])


def clear_dropped(plan: RowPlan, dtopk_w_LK: torch.Tensor, act_scaled_RH: torch.Tensor,
                  dpreact_RF: torch.Tensor) -> torch.Tensor:
    """For a routing with dropped pairs, before the weight gradients: dropped pairs' rows were never computed and
    hold whatever was there, so their dS is 0 (returned), and since the weight gradients reduce over whole row
    blocks, whose rows past the last expert's end (a block at most) meet zeros on the gathered side, those rows of
    s·A and dH are zeroed in place, so that no NaN there spreads."""
    _zero_rows_from(act_scaled_RH, plan.kept)
    _zero_rows_from(dpreact_RF, plan.kept)
    return dtopk_w_LK.masked_fill(plan.token_slot_LK >= plan.kept, 0)


def _grad_or_empty(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """An optional input's gradient, or an empty tensor where the input is absent (a custom op returns tensors
    only)."""
    return g if g is not None else like.new_empty(0)


def experts_backward(dy_LD: torch.Tensor, inputs: OpInputs, kept: Kept, key: str,
                     overwrite_kept: bool = False) -> tuple[torch.Tensor, ...]:
    """The gradients of the DIFFERENTIABLE fields, in that order (dx, dw1, dw2, dtopk_w, db1, db2, dw1_up), each
    empty where its input is absent: the backward body. The weights' gradients come in the weights' own layouts
    (strides), dw1 and dw1_up apart where W1 came in two parts. overwrite_kept: the kept bf16 preact has no reader
    after this call (eager autograd, graph not kept), so dH may be written over it."""
    x_LD, w1_EFD, w2_EDH, topk_w_LK, b1_EF, b2_ED, w1_up = (inputs.x, inputs.w1, inputs.w2, inputs.topk_w,
                                                            inputs.b1, inputs.b2, inputs.w1_up)
    if dy_LD.is_cuda:  # autograd runs this on a thread of its own: TMA descriptors need its CUDA context current
        ensure_context(dy_LD.get_device())
    none = x_LD.new_empty(0)
    if x_LD.shape[0] == 0:  # an empty batch: nothing flows back but zeros
        return (torch.zeros_like(x_LD), torch.zeros_like(w1_EFD), torch.zeros_like(w2_EDH),
                torch.zeros_like(topk_w_LK),
                *(none if t is None else torch.zeros_like(t) for t in (b1_EF, b2_ED, w1_up)))
    r = parse(key)
    g = r.gemms
    plan = kept.plan(inputs)
    recomputed = r.checkpoint == "recompute"
    preact_RF = g.preact(plan, x_LD, inputs) if recomputed else kept.preact
    preact_scale = kept.preact_scale if r.checkpoint == "preact-fp8" else None
    overwrite = recomputed or (overwrite_kept and r.checkpoint == "preact" and preact_RF.dtype == dy_LD.dtype)
    dpreact_RF, act_scaled_RH, dtopk_w, dpreact_q = g.dact(plan, dy_LD, w2_EDH, preact_RF, preact_scale, topk_w_LK,
                                                           overwrite)
    del preact_RF, kept
    if r.dropped:
        dtopk_w = clear_dropped(plan, dtopk_w, act_scaled_RH, dpreact_RF)
    # the weight gradients in the weights' dtype: x's, or float32 for master weights (the kernels' fp32 sums
    # stored as they are, no cast pass)
    dw2 = stages.weight_grad(plan, dy_LD, act_scaled_RH, torch.empty_like(w2_EDH), True, r.backend)
    del act_scaled_RH
    # dX~ and its combine before dW1's buffer exists: the (R, D) rows and dW1 are never alive together
    dx_RD = g.dx_rows(plan, dpreact_RF, dpreact_q, inputs)
    del dpreact_q
    dx = stages.combine(plan, dx_RD, None, x_LD.dtype)
    del dx_RD
    dw1_up = None if w1_up is None else torch.empty_like(w1_up)
    dw1 = stages.weight_grad(plan, dpreact_RF, x_LD, torch.empty_like(w1_EFD), False, r.backend, out_up=dw1_up)
    db1, db2, ds_b = stages.bias_grads(plan, dy_LD, dpreact_RF, topk_w_LK, b1_EF, b2_ED, r.backend)
    if ds_b is not None:
        dtopk_w = (dtopk_w.float() + ds_b).to(topk_w_LK.dtype)
    return dx, dw1, dw2, dtopk_w, *(_grad_or_empty(g, x_LD) for g in (db1, db2, dw1_up))


def _graph_kept() -> bool:
    """Whether the running backward keeps the graph for another (retain_graph, create_graph); True where this torch
    cannot say."""
    kept = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if kept is None else bool(kept())


class OpOptions(NamedTuple):
    """The op's non-tensor options: the call's OpKey as text."""
    key: str


# The op declared once (moeblaze.declare): its custom-op pair, what torch.compile traces, and the eager Function.
# Backward needs no counts (the tile schedule holds them): an empty tensor is kept in their place. The eager
# Function's saved preact is read by no one after its backward unless the graph is kept (the custom op's schema
# declares no mutation, so its backward never writes over an input).
EXPERTS = Op("experts", inputs=OpInputs, kept=Kept, options=OpOptions, results=("out",), grads=DIFFERENTIABLE,
             forward=lambda inputs, o: experts_forward(inputs, o.key),
             backward=lambda dy, inputs, kept, o: experts_backward(dy, inputs, kept, o.key),
             forward_fake=_forward_fake, contiguous=("x", "topk_w"),
             save=lambda i: i._replace(expert_counts=i.expert_counts.new_empty(0)),
             eager_backward=lambda dy, inputs, kept, o: experts_backward(dy, inputs, kept, o.key,
                                                                          overwrite_kept=not _graph_kept()))


def fused_experts(inputs: OpInputs, key: str) -> torch.Tensor:
    """The experts' combined output (L, D), differentiable in every DIFFERENTIABLE field of `inputs` that is given:
    the custom op where torch.compile traces, the direct path in eager mode. key: an OpKey's text. Overridable
    through __torch_function__ (a mode, such as the memory profiler, sees it as one op)."""
    dense = tuple(t for t in inputs if t is not None)
    if torch.overrides.has_torch_function(dense):
        return torch.overrides.handle_torch_function(fused_experts, dense, inputs, key)
    return EXPERTS(inputs, OpOptions(key))[0]
