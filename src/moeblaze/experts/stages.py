"""The stages of the fused expert computation, each one launch (down_bwd: two on Gluon), with one signature
shape: `stage(plan, *operands, ..., backend="auto")`, where `plan` (RowPlan) holds the routing index's arrays
and the tile schedule, and `backend` ("auto", "tl", "gluon") is resolved per launch by experts.dispatch.
The autograd layer, the benchmark's per-stage timing and the scripts all call these.

Forward:
  up           preact = x[token] @ W1[e]ᵀ, act = activation(preact)     gather in the load, activation in the
                                                                     epilogue; either output may be skipped
  down         Y = act @ W2[e]ᵀ                                       (R, D), transient
  combine      out[t] = sum_k w[t, k] · Y[token_slot[t, k]]              fp32 sums in fixed order, no atomics
Backward:
  down_bwd     dA' = dy[token] @ W2[e]; from it and preact: dH, s·A and dS (the router weights' gradient)
  act_bwd      the same epilogue as a pass of its own, from a dA' computed apart (Gluon's down_bwd runs it)
  weight_grad  dW[e] = P[rows of e]ᵀ Q[rows of e], one side gathered: dW2 = dy[token]ᵀ (s·A), dW1 = dHᵀ x[token]
  bias_grads   the biases' gradients (the weight-gradient kernel against a column) and their share of dS
  dx_rows      dX~ = dH @ W1[e]                                       (R, D), transient
  combine      dx[t] = sum_k dX~[token_slot[t, k]]

Memory contract: each stage allocates its outputs only (see experts.op for what a step keeps); no stage
ever allocates an (R, D) copy of x or dy.

Legend: L tokens, D hidden, H expert intermediate, F rows of W1 per expert (2H gated, H plain), E experts,
K top-k, R = L·K routed rows (the (token, expert) pairs in expert order).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..routing import RoutingIndex
from ..routing.index import in_row_order, pair_experts
from . import dispatch, gluon_sm90, quant, tl
from .schedule import BLOCK_M, tile_schedule


@dataclass(frozen=True)
class RowPlan:
    """The R routed rows of one routing in expert order, and the tile schedule every expert GEMM walks.

    token_R: expert_token_idx (each row's token); offsets_E1: expert e owns rows [offsets[e], offsets[e+1]);
    token_slot_LK: the row of pair (t, k); tile_expert, tile_row, tiles_used: the schedule (experts.schedule).
    """
    token_R: torch.Tensor
    offsets_E1: torch.Tensor
    token_slot_LK: torch.Tensor
    tile_expert: torch.Tensor
    tile_row: torch.Tensor
    tiles_used: torch.Tensor

    @classmethod
    def build(cls, routing: RoutingIndex, block_m: int = BLOCK_M) -> RowPlan:
        """The plan of a routing index: its arrays and a fresh tile schedule (one launch)."""
        sched = tile_schedule(routing.expert_counts, routing.expert_offsets, routing.expert_token_idx.shape[0],
                              block_m)
        return cls(routing.expert_token_idx, routing.expert_offsets, routing.token_slot, *sched)

    @property
    def sched(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tile_expert, self.tile_row, self.tiles_used

    @property
    def kept(self) -> torch.Tensor:
        """(1,) int32: rows [0, kept) belong to experts; the rest are dropped pairs (routing.index's sentinels)."""
        return self.offsets_E1[-1:]

    @property
    def pair_expert(self) -> torch.Tensor:
        """(L, K) int32: the expert of each pair (E for dropped pairs), from its row and the offsets."""
        return pair_experts(self.offsets_E1, self.token_slot_LK)

    @property
    def num_rows(self) -> int:
        return self.token_R.shape[0]


def whole_w1(w1_EFD: torch.Tensor, w1_up: torch.Tensor | None) -> torch.Tensor:
    """W1 (E, F, D): w1 itself, or [gate rows | up rows] where the up rows come apart (a transient copy)."""
    return w1_EFD if w1_up is None else torch.cat((w1_EFD, w1_up), 1)


def up(plan: RowPlan, x_LD, w1_EFD, activation: str, store_preact: bool = True, store_act: bool = True, *,
       backend: str = "auto", b1_EF=None, interleaved: bool = False, w1_up=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(preact (R, F), act (R, H)) with the bias b1 (E, F) where given; an empty tensor for one not stored.
    preact's gate/up columns follow W1's rows (interleaved: gate at even rows). w1_up: W1's up rows, where w1_EFD
    holds only the gate rows (read in place on Gluon; concatenated for tl, a transient copy)."""
    plain = b1_EF is None and not interleaved
    if dispatch.up(backend, x_LD, w1_EFD, activation, plain, w1_up) == "gluon":
        preact, act = gluon_sm90.up_swiglu(x_LD, w1_EFD, plan.token_R, plan.offsets_E1, plan.sched, w1_up=w1_up,
                                           store_preact=store_preact, store_act=store_act)
        return (preact if store_preact else x_LD.new_empty(0)), (act if store_act else x_LD.new_empty(0))
    w1_EFD = whole_w1(w1_EFD, w1_up)
    return tl.up(x_LD, w1_EFD, plan.token_R, plan.offsets_E1, plan.sched, activation, store_preact, store_act,
                 b1_EF=b1_EF, interleaved=interleaved)


def down(plan: RowPlan, act_RH, w2_EDH, backend: str = "auto") -> torch.Tensor:
    """Y (R, D) = act[rows of e] @ W2[e]ᵀ."""
    if dispatch.rows("down", backend, act_RH, w2_EDH) == "gluon":
        return gluon_sm90.rows_gemm(act_RH, w2_EDH, plan.offsets_E1, plan.sched)
    return tl.rows_gemm(act_RH, w2_EDH, (w2_EDH.stride(0), w2_EDH.stride(2), w2_EDH.stride(1)), w2_EDH.shape[1],
                        plan.offsets_E1, plan.sched)


def dx_rows(plan: RowPlan, dpreact_RF, w1_EFD, backend: str = "auto", *, w1_up=None) -> torch.Tensor:
    """dX~ (R, D) = dH[rows of e] @ W1[e]. w1_up: W1's up rows, where w1_EFD holds only the gate rows (read in place
    on Gluon; concatenated for tl, a transient copy)."""
    if dispatch.rows("dx_rows", backend, dpreact_RF, w1_EFD, w1_up) == "gluon":
        return gluon_sm90.rows_gemm(dpreact_RF, w1_EFD, plan.offsets_E1, plan.sched, kn=True, w_up=w1_up)
    w1_EFD = whole_w1(w1_EFD, w1_up)
    return tl.rows_gemm(dpreact_RF, w1_EFD, (w1_EFD.stride(0), w1_EFD.stride(1), w1_EFD.stride(2)), w1_EFD.shape[2],
                        plan.offsets_E1, plan.sched)


def combine(plan: RowPlan, rows_RD, weights_LK: torch.Tensor | None, out_dtype: torch.dtype,
            backend: str = "auto", bias_ED=None) -> torch.Tensor:
    """out (L, D)[t] = sum_k (weights[t, k] ·) (rows[token_slot[t, k]] (+ bias[e] of the pair's expert e, where a
    bias (E, D) is given)); a plain sum where weights is None. One kernel on every backend."""
    return tl.combine(rows_RD, plan.token_slot_LK, weights_LK, plan.kept, out_dtype, bias_ED,
                      plan.pair_expert if bias_ED is not None else None)


def combine_slots(rows_RD, slot_LK, weights_LK: torch.Tensor | None, kept, out_dtype: torch.dtype) -> torch.Tensor:
    """combine over explicit slots: out[t] = sum_k (weights[t, k] ·) rows[slot[t, k]], slots >= kept (a (1,) int32
    tensor) adding 0 (expert parallelism's combine of the rows its experts sent back)."""
    return tl.combine(rows_RD, slot_LK, weights_LK, kept, out_dtype)


def down_bwd(plan: RowPlan, dy_LD, w2_EDH, preact_RF, topk_w_LK, dpreact_RF, activation: str, *,
             backend: str = "auto", interleaved: bool = False, preact_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """dH into dpreact (which may be preact itself: each element is read before it is written); returns
    (s·A (R, H), the router weights' gradient dS (L, K) in topk_w's dtype, without a down-projection bias's
    term, which bias_grads adds). preact in e4m3 comes with its 1 x 128 scales (preact_scale) and dpreact is then
    a buffer of its own, in the io dtype: the Gluon path reads H back inside the dH pass, the tl one into dpreact
    first (one pass) and computes dH over it."""
    if dispatch.down_bwd(backend, dy_LD, w2_EDH, preact_RF) == "gluon":
        # dA' by the gathering GEMM into the s·A buffer, then the epilogue as its own pass, which overwrites dA'
        # with s·A (a fused epilogue leaves the tensor cores idle at ~60% of the rate)
        act_scaled = gluon_sm90.gathered_rows_gemm(dy_LD, w2_EDH, plan.token_R, plan.offsets_E1, plan.sched)
        return act_scaled, act_bwd(plan, act_scaled, preact_RF, topk_w_LK, dpreact_RF, act_scaled, activation,
                                   interleaved=interleaved, preact_scale=preact_scale)
    if preact_scale is not None:
        preact_RF = quant.dequantize_rows(preact_RF, preact_scale, dpreact_RF.dtype, out=dpreact_RF)
    return tl.down_bwd(dy_LD, w2_EDH, preact_RF, topk_w_LK, dpreact_RF, plan, activation, interleaved=interleaved)


def act_bwd(plan: RowPlan, dact_RH, preact_RF, topk_w_LK, dpreact_RF, act_scaled_RH, activation: str, *,
            backend: str = "auto", interleaved: bool = False, preact_scale=None, dpreact_q=None) -> torch.Tensor:
    """From dA' and preact: dH into dpreact, s·A into act_scaled (either may alias its input); returns dS (L, K).
    preact in e4m3 with its scales (preact_scale) is read back as it is loaded; dpreact_q, a (q, scales) pair,
    receives dH quantized in 1 x 128 groups as it is stored (tl.dh_quantizable). One kernel on every backend."""
    return tl.act_bwd(dact_RH, preact_RF, plan.token_R, plan.token_slot_LK, topk_w_LK, dpreact_RF, act_scaled_RH,
                      activation, interleaved=interleaved, preact_scale=preact_scale, dpreact_q=dpreact_q)


def weight_grad(plan: RowPlan, p, q, out, gather_p: bool, backend: str = "auto", *, out_up=None) -> torch.Tensor:
    """dW (E, N, P) written into out (any strides: a weight's own layout), dW[e] = P[rows of e]ᵀ Q[rows of e];
    P = p[token] if gather_p, else Q = q[token] (the other side row by row). out_up: dW's last rows apart (dW1's up
    rows, P's last columns), dW[e] = [out[e]; out_up[e]]: one launch storing to both on Gluon; on tl, dW whole into
    a transient and copied to the parts (the same tiles as for one W1, so the same bits). Returns out."""
    if dispatch.weight_grad(backend, p, q, out, gather_p, out_up) == "gluon":
        return gluon_sm90.weight_grad(p, q, plan.token_R, plan.offsets_E1, out, gather_p, out_up=out_up)
    if out_up is None:
        return tl.weight_grad(p, q, out, plan.token_R, plan.offsets_E1, gather_p)
    whole = tl.weight_grad(p, q, out.new_empty(out.shape[0], out.shape[1] + out_up.shape[1], out.shape[2]),
                           plan.token_R, plan.offsets_E1, gather_p)
    out.copy_(whole[:, :out.shape[1]])
    out_up.copy_(whole[:, out.shape[1]:])
    return out


def bias_grads(plan: RowPlan, dy_LD, dpreact_RF, topk_w_LK, b1_EF, b2_ED, backend: str = "auto"
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The biases' gradients and the down-projection bias's share of dS, each None where its bias is:
    dB1[e] = Σ_{rows r of e} dH[r], dB2[e] = Σ_{rows r of e} s_r · dy[token_r] (reductions over each expert's
    rows in fixed order: the weight-gradient kernel against a column of ones or of router weights), and
    dS_b[t, k] = <dy[t], b2[e]> of the pair's expert e (0 for dropped pairs), through the (L, E) product dy b2ᵀ.
    Memory: the (R,) router weights in row order and dy b2ᵀ (L·E fp32), transient."""
    db1 = db2 = ds_b = None
    if b1_EF is not None:
        ones = dpreact_RF.new_ones(1, 1).expand(dy_LD.shape[0], 1)
        db1 = weight_grad(plan, dpreact_RF, ones, b1_EF.new_empty(*b1_EF.shape, 1), False, backend)[..., 0]
    if b2_ED is not None:
        s_R = in_row_order(topk_w_LK, plan.token_slot_LK, plan.num_rows, dy_LD.dtype).view(-1, 1)
        db2 = weight_grad(plan, dy_LD, s_R, b2_ED.new_empty(*b2_ED.shape, 1), True, backend)[..., 0]
        E = b2_ED.shape[0]
        e_LK = plan.pair_expert.long()
        g_LE = dy_LD.float() @ b2_ED.float().t()
        ds_b = g_LE.gather(1, e_LK.clamp(max=E - 1)).masked_fill(e_LK >= E, 0)
    return db1, db2, ds_b
