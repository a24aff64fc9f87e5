"""Host side of the tl kernels: buffers, grids, tensor descriptors and launches, one function per kernel.

Operands that are not gathered go through host tensor descriptors (TMA on Hopper) where they are aligned for
them (launch.tma_ok), through pointers otherwise; the autotuner's pre-hooks give the descriptors their block
shapes. Memory: each function allocates its outputs only (down_bwd: also its router weights in row order and
the fp32 dS partials, 4·L·K·(1 + H / DS_BLOCK) bytes, freed on return).

Legend: R = L·K routed rows, D hidden, H expert intermediate, F rows of W1 per expert, E experts, K top-k.
"""
from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ...env import INTERPRET
from ...launch import cdiv, launch, sm_count, tma_ok
from ...reference import is_gated
from ...routing.index import in_row_order
from ..schedule import BLOCK_M
from .backward import _act_bwd_kernel, _down_bwd_kernel, _weight_grad_kernel
from .common import ACT_CODES
from .configs import DS_BLOCK, GROUP_M
from .forward import _combine_kernel, _rows_kernel, _up_kernel

TUNED_KERNELS = {"up": _up_kernel, "rows": _rows_kernel, "down_bwd": _down_bwd_kernel,
                 "weight_grad": _weight_grad_kernel}


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _desc(t: torch.Tensor | None):
    """A host tensor descriptor of 2D t where t is aligned for one, else None; its block shape is set per
    autotune config by the kernel's pre-hook."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1]) if tma_ok(t) else None


def _grid(num_tiles: int, n: int, device: torch.device | None = None):
    """One program per (row tile, column tile); persistent configs: one per multiprocessor."""
    sms = sm_count(device) if device is not None else None
    return lambda meta: ((sms if meta.get("PERSISTENT") else num_tiles * cdiv(n, meta["BLOCK_N"])),)


def up(x_LD, w1_EFD, token_R, offsets, sched, activation, store_preact, store_act, *, b1_EF=None, interleaved=False):
    """(preact (R, F), act (R, H)) = x[token] @ W1[e]ᵀ (+ b1[e]) and its activation; an empty tensor for one not
    stored. preact's gate/up columns follow W1's rows (interleaved or not)."""
    R, (_, F, D) = token_R.shape[0], w1_EFD.shape
    H = F // 2 if is_gated(activation) else F
    preact = x_LD.new_empty(R, F) if store_preact else x_LD.new_empty(0)
    act = x_LD.new_empty(R, H) if store_act else x_LD.new_empty(0)
    num_tiles = sched[0].shape[0]
    w1_desc = _desc(w1_EFD.reshape(-1, D) if w1_EFD.is_contiguous() and not interleaved else None)
    b1 = b1_EF if b1_EF is not None else w1_EFD[:, 0]
    _up_kernel[_grid(num_tiles, H)](
        x_LD, w1_EFD, w1_desc or w1_EFD, b1, preact, act, token_R, sched[0], sched[1], offsets,
        num_tiles, D, H, x_LD.stride(0), x_LD.stride(1), w1_EFD.stride(0), w1_EFD.stride(1), w1_EFD.stride(2),
        b1.stride(0), b1.stride(1), F, H, GATED=is_gated(activation), ACT=ACT_CODES[activation],
        INTERLEAVED=interleaved, HAS_B1=b1_EF is not None, STORE_PREACT=store_preact, STORE_ACT=store_act,
        W1_TMA=w1_desc is not None, BLOCK_M=BLOCK_M, PRECISION=_precision(x_LD.dtype), GROUP_M=GROUP_M)
    return preact, act


def rows_gemm(a, b, b_strides_ekn, n, offsets, sched):
    """C (rows, n) = A[rows] @ B[e] with B[e] addressed as (k, n) through b_strides_ekn."""
    c = a.new_empty(a.shape[0], n)
    num_tiles = sched[0].shape[0]
    a_desc, b_desc = _desc(a), _desc(b.reshape(-1, b.shape[2]) if b.is_contiguous() else None)
    _rows_kernel[_grid(num_tiles, n, a.device)](
        a, b, a_desc or a, b_desc or b, c, sched[0], sched[1], sched[2], offsets, num_tiles, n, a.shape[1], b.shape[1],
        a.stride(0), a.stride(1), *b_strides_ekn, c.stride(0), A_TMA=a_desc is not None,
        B_TMA=b_desc is not None, B_KMAJOR=b_strides_ekn[1] == 1, BLOCK_M=BLOCK_M, PRECISION=_precision(a.dtype),
        GROUP_M=GROUP_M)
    return c


WIDE_TABLE = 8  # wider per-token tables (token rounding's) are summed only up to each token block's last used column


def combine(rows_RD, token_slot_LK, weights_LK, kept, out_dtype, bias_ED=None, pair_expert_LK=None):
    """out[t] = sum_k (w[t, k] *) (rows[token_slot[t, k]] (+ bias[pair_expert[t, k]])), (L, D) in out_dtype, fp32
    sums in fixed order; slots >= kept[0] (a one-element int32 tensor: the routing's kept rows) add nothing."""
    L, K = token_slot_LK.shape
    D = rows_RD.shape[1]
    out = torch.empty(L, D, dtype=out_dtype, device=rows_RD.device)
    bt, bd = (16, 32) if INTERPRET else (16, 256)
    bias = bias_ED if bias_ED is not None else rows_RD
    launch(_combine_kernel, (cdiv(L, bt), cdiv(D, bd)), rows_RD, token_slot_LK,
           weights_LK if weights_LK is not None else rows_RD, kept, bias,
           pair_expert_LK if pair_expert_LK is not None else token_slot_LK, out, L, D, rows_RD.stride(0),
           bias.stride(0), bias.stride(1), out.stride(0), K=K, WEIGHTED=weights_LK is not None,
           HAS_BIAS=bias_ED is not None, WIDE=K > WIDE_TABLE,
           K_POW2=triton.next_power_of_2(K), BLOCK_T=bt, BLOCK_D=bd, num_warps=4)
    return out


def weight_grad(p, q, dw, token_R, offsets, gather_p):
    """dW (E, N, P), written into dw (any strides), with dW[e] = P[rows of e]ᵀ Q[rows of e], P = p[token] if
    gather_p else Q = q[token]."""
    E, N, P = dw.shape
    desc = _desc(q if gather_p else p)
    grid = lambda meta: (E * cdiv(N, meta["BLOCK_N"]) * cdiv(P, meta["BLOCK_P"]),)  # noqa: E731
    _weight_grad_kernel[grid](
        p, q, desc or p, dw, token_R, offsets, N, P, p.stride(0), p.stride(1), q.stride(0), q.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2), GATHER_P=gather_p, GATHER_Q=not gather_p, DENSE_TMA=desc is not None,
        PRECISION=_precision(p.dtype))
    return dw


def down_bwd(dy_LD, w2_EDH, preact, topk_w_LK, dpreact, plan, activation, *, interleaved=False):
    """dA' = dy[token] @ W2[e] with the activation's backward in the epilogue: dH into dpreact (may be preact
    itself); returns s·A (R, H) and the router weights' gradient (L, K) without any down-projection bias term."""
    token_R, token_slot_LK, offsets, sched = plan.token_R, plan.token_slot_LK, plan.offsets_E1, plan.sched
    R, (_, D, H) = token_R.shape[0], w2_EDH.shape
    act_scaled = dy_LD.new_empty(R, H)
    w_sorted = in_row_order(topk_w_LK, token_slot_LK, R, torch.float32)  # router weights in row order
    ds_part = torch.empty(cdiv(H, DS_BLOCK), R, dtype=torch.float32, device=dy_LD.device)
    num_tiles = sched[0].shape[0]
    w2_desc = _desc(w2_EDH.reshape(-1, H) if w2_EDH.is_contiguous() else None)
    _down_bwd_kernel[_grid(num_tiles, H)](
        dy_LD, w2_EDH, w2_desc or w2_EDH, preact, w_sorted, dpreact, act_scaled, ds_part, token_R, sched[0], sched[1],
        offsets, num_tiles, D, H, R, dy_LD.stride(0), dy_LD.stride(1), w2_EDH.stride(0), w2_EDH.stride(1),
        w2_EDH.stride(2), preact.stride(0), H, GATED=is_gated(activation), ACT=ACT_CODES[activation],
        INTERLEAVED=interleaved, DS_BLOCK=DS_BLOCK, W2_TMA=w2_desc is not None,
        BLOCK_M=BLOCK_M, PRECISION=_precision(dy_LD.dtype), GROUP_M=GROUP_M)
    return act_scaled, ds_part.sum(0)[token_slot_LK.long()].to(topk_w_LK.dtype)  # dropped pairs: masked by the caller


def act_bwd(dact_RH, preact, token_R, token_slot_LK, topk_w_LK, dpreact, act_scaled, activation, *,
            interleaved=False, preact_scale=None, dpreact_q=None, block_r: int | None = None,
            num_warps: int | None = None):
    """From dA' (R, H) and H: dH into dpreact, s·A into act_scaled (either may alias its input); returns dS as
    the router weights' gradient (L, K), in topk_w's dtype. H in e4m3 comes with its 1 x 128 scales
    (preact_scale) and is read back in dpreact's dtype as it is loaded (dpreact is then a buffer of its own).
    dpreact_q: (q (R, F) e4m3, scales (R, ceil(F / 128)) fp32) that receive quant.quantize_rows(dH) as dH is
    stored (dH_quantizable says where). block_r (rows a program) and num_warps: the launch's shape."""
    R, H = dact_RH.shape
    topk_w_LK = topk_w_LK.contiguous()
    dtopk_w = torch.empty_like(topk_w_LK)
    fp8 = preact_scale is not None
    scale = preact_scale if fp8 else preact
    quant_dh = dpreact_q is not None
    if quant_dh and not dh_quantizable(H, activation, interleaved):
        raise ValueError(f"act_bwd: dH of {activation} (interleaved={interleaved}) with H = {H} is not quantized "
                         f"in the pass; quantize it apart")
    dq, dqs = dpreact_q if quant_dh else (dpreact, scale)
    K = token_slot_LK.shape[1]  # a token-rounded routing's table is wider (WIDE): read a row's places at once
    # rows a program x 256 columns (whole 128-column groups, which QUANT_DH needs) and warps, by
    # the fp8 kernel lab of docs/notes/ (configs D, B, E, H200): quantizing dH, 2 rows on 2 warps, 0.80-0.85x
    # the time of 8 rows on 4 at D, B and E; without, 4 rows on 4 warps, 0.96-0.99x (16 rows or 8 warps: no faster)
    block_r, block_h = (4, 128) if INTERPRET else (block_r or (2 if quant_dh else 4), 256)
    num_warps = num_warps or (2 if quant_dh else 4)
    launch(_act_bwd_kernel, (cdiv(R, block_r),), dact_RH, preact, scale, token_R, token_slot_LK, topk_w_LK,
           dpreact, act_scaled, dtopk_w, dq, dqs, R, H, dact_RH.stride(0), preact.stride(0), scale.stride(0),
           act_scaled.stride(0), dq.stride(0), dqs.stride(0), K=K, GATED=is_gated(activation),
           ACT=ACT_CODES[activation], INTERLEAVED=interleaved, FP8_H=fp8, H_ALIGNED=H % 128 == 0,
           QUANT_DH=quant_dh, WIDE=K > WIDE_TABLE,
           K_POW2=triton.next_power_of_2(K), BLOCK_R=block_r, BLOCK_H=block_h, num_warps=num_warps)
    return dtopk_w


def dh_quantizable(H: int, activation: str, interleaved: bool) -> bool:
    """Whether act_bwd can quantize dH as it stores it: its 1 x 128 groups fall within a pass's columns, which
    holds unless dH is gate-first with H not a multiple of 128 (then its up groups straddle two passes)."""
    return not is_gated(activation) or interleaved or H % 128 == 0
