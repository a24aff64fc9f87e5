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

import torch

from ..routing.index import in_row_order
from . import dispatch, tl
from .schedule import RowPlan


def up(plan: RowPlan, x_LD, w1_EFD, activation: str, store_preact: bool = True, store_act: bool = True, *,
       backend: str = "auto", b1_EF=None, interleaved: bool = False, w1_up=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(preact (R, F), act (R, H)) with the bias b1 (E, F) where given; an empty tensor for one not stored.
    preact's gate/up columns follow W1's rows (interleaved: gate at even rows). w1_up: W1's up rows, where w1_EFD
    holds only the gate rows (read in place on Gluon; concatenated for tl, a transient copy)."""
    return dispatch.launch("up", backend, x_LD.device, plan, x_LD, w1_EFD, activation, store_preact, store_act,
                           b1_EF=b1_EF, interleaved=interleaved, w1_up=w1_up)


def down(plan: RowPlan, act_RH, w2_EDH, backend: str = "auto") -> torch.Tensor:
    """Y (R, D) = act[rows of e] @ W2[e]ᵀ."""
    return dispatch.launch("down", backend, act_RH.device, plan, act_RH, w2_EDH)


def dx_rows(plan: RowPlan, dpreact_RF, w1_EFD, backend: str = "auto", *, w1_up=None) -> torch.Tensor:
    """dX~ (R, D) = dH[rows of e] @ W1[e]. w1_up: W1's up rows, where w1_EFD holds only the gate rows (read in place
    on Gluon; concatenated for tl, a transient copy)."""
    return dispatch.launch("dx_rows", backend, dpreact_RF.device, plan, dpreact_RF, w1_EFD, w1_up=w1_up)


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
    return dispatch.launch("down_bwd", backend, dy_LD.device, plan, dy_LD, w2_EDH, preact_RF, topk_w_LK, dpreact_RF,
                           activation, interleaved=interleaved, preact_scale=preact_scale)


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
    return dispatch.launch("weight_grad", backend, p.device, plan, p, q, out, gather_p, out_up=out_up)


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
