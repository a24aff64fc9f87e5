"""precision="fp8": the experts with their four data GEMMs on e4m3 operands (DeepSeek-V3's recipe, reference.fp8's
quantizers), as an autograd op composed from stages. Correct first, not yet fast: it is the arithmetic of
reference.moe_experts_reference(fp8_gemms=True) on the kernels, every quantization one pass (experts.tl.quant).
Each fp8 GEMM (fp8_rows_gemm below) runs on the Hopper kernel (gluon_sm90.fp8) where experts.dispatch takes
its operands, on the portable one (tl.fp8) elsewhere.

Forward:   x_q = q(x) by token;  H = x_q[token] · q(W1[e])ᵀ   (fp8_rows_gemm, gathered)
           q(A) = q(SiLU(gate)·up) from H in one pass (other activations: act(H) in torch, then q)
           Y = q(A) · q(W2[e])ᵀ                                (fp8_rows_gemm)
           out = combine(w · Y)                                 (stages.combine, fp32 sums)
Backward:  dA' = q(dy)[token] · q(W2[e]ᵀ)ᵀ                      (fp8_rows_gemm, gathered; q(W2ᵀ) written K-major
                                                                 from W2 in one pass: the same 128 x 128 blocks)
           dH, s·A, dS from dA' and H                           (stages.act_bwd)
           dW2 = dy[token]ᵀ (s·A), dW1 = dHᵀ x[token]           (stages.weight_grad, input precision)
           dX~ = q(dH) · q(W1[e]ᵀ)ᵀ; dx = combine(dX~)           (fp8_rows_gemm, stages.combine)
q: quantize_rows for activations and gradients (1 x 128 groups), quantize_blocks for weights (128 x 128).

Memory contract: as experts.autograd's for the same checkpoint (H under "preact", in e4m3 under "preact-fp8",
recomputed by the fp8 up GEMM under "recompute"); transient: x_q, q(A), q(dy), q(dH) and the weights' e4m3 copies.
The weights are quantized where they are used, forward and backward, never kept between them: under FSDP2 the
gathered weights are freed after forward, and a copy kept for backward would hold them (in e4m3) through the
step; no cache across steps either, so no copy can go stale. Not yet: biases, chunk_tokens, torch.compile, expert
parallelism; these raise. On CUDA it needs fp8 tensor cores (sm_89 or later).
"""
from __future__ import annotations

import torch

from ..reference import apply_activation
from ..routing import RoutingIndex
from . import dispatch, gluon_sm90, stages
from .autograd import clear_dropped
from .stages import RowPlan
from .tl import quant
from .tl.fp8 import fp8_rows_gemm

PRECISIONS = ("native", "fp8")


def check_fp8_supported(x: torch.Tensor, b1, b2, chunk_tokens) -> None:
    """Raise where precision="fp8" cannot run this call (see the module header)."""
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 9):
        raise RuntimeError(f"precision='fp8' needs fp8 tensor cores (sm_89 or later); "
                           f"{torch.cuda.get_device_name(x.device)} has none: use precision='native'")
    if b1 is not None or b2 is not None:
        raise NotImplementedError("precision='fp8' with expert biases is not built yet")
    if chunk_tokens is not None:
        raise NotImplementedError("precision='fp8' with chunk_tokens is not built yet")
    if torch.compiler.is_compiling():
        raise NotImplementedError("precision='fp8' under torch.compile is not built yet (eager only)")


def quantize_weight(w_ENK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q(W) (E, N, K) K-major and its 128 x 128 scales for W (E, N, K) in any layout: a transposed view (K-major
    storage of Wᵀ, as gpt-oss keeps W1 and W2, or backward's Wᵀ of a plain W) is written K-major in one pass."""
    if w_ENK.stride(2) != 1 and w_ENK.stride(1) == 1:
        return quant.quantize_blocks(w_ENK.transpose(1, 2), transpose=True)
    return quant.quantize_blocks(w_ENK.contiguous())


def _rows(plan: RowPlan, a_q, w_q, out_dtype, backend, token=None):
    """C[rows] = q(A)[token[rows] if token is given, else rows] · q(W[e])ᵀ: (a_q, a_scale), (w_q, w_scale); on the
    Hopper kernel where experts.dispatch takes the operands, else on tl."""
    gemm = fp8_rows_gemm
    if dispatch.fp8_rows(backend, a_q[0], w_q[0], out_dtype, token is not None) == "gluon":
        gemm = gluon_sm90.fp8_rows_gemm
    return gemm(*a_q, *w_q, plan.num_rows, plan.offsets_E1, plan.sched, token, out_dtype)


def _act_quantized(preact, activation, interleaved):
    """q(act(H)) in 1 x 128 groups: one pass from H for SwiGLU, act in torch and then one pass otherwise."""
    if activation == "swiglu":
        return quant.swiglu_quantize(preact, interleaved)
    return quant.quantize_rows(apply_activation(preact, activation, interleaved))


class Fp8Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_LD, w1_EFD, w2_EDH, topk_w_LK, counts, offsets, eti, slot, activation, checkpoint,
                dropped, interleaved, backend):
        plan = RowPlan.build(RoutingIndex(counts, offsets, eti, slot))
        dt = x_LD.dtype
        if x_LD.shape[0] == 0:
            out, preact = x_LD.new_zeros(x_LD.shape), x_LD.new_zeros(0, w1_EFD.shape[1])
        else:
            preact = _rows(plan, quant.quantize_rows(x_LD), quantize_weight(w1_EFD), dt, backend, token=plan.token_R)
            y = _rows(plan, _act_quantized(preact, activation, interleaved), quantize_weight(w2_EDH), dt, backend)
            out = stages.combine(plan, y, topk_w_LK.float().contiguous(), dt)
        kept, scale = preact, preact.new_empty(0, dtype=torch.float32)
        if checkpoint == "preact-fp8":
            kept, scale = quant.quantize_rows(preact)
        elif checkpoint == "recompute":
            kept = preact.new_empty(0)
        ctx.save_for_backward(x_LD, w1_EFD, w2_EDH, topk_w_LK, kept, scale, *plan.sched, offsets, eti, slot)
        ctx.activation, ctx.checkpoint, ctx.dropped, ctx.interleaved = activation, checkpoint, dropped, interleaved
        ctx.backend = backend
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w1, w2, topk_w, kept, scale, te, tr, tu, offsets, eti, slot = ctx.saved_tensors
        if x.shape[0] == 0:
            return (torch.zeros_like(x), torch.zeros_like(w1), torch.zeros_like(w2), torch.zeros_like(topk_w),
                    *(None,) * 9)
        plan = RowPlan(eti, offsets, slot, te, tr, tu)
        dt, dy = x.dtype, dout.contiguous()
        if ctx.checkpoint == "recompute":
            preact = _rows(plan, quant.quantize_rows(x), quantize_weight(w1), dt, ctx.backend, token=plan.token_R)
        elif ctx.checkpoint == "preact-fp8":
            preact = quant.dequantize_rows(kept, scale, dt)
        else:
            preact = kept
        # dA' = dy[token] W2, e4m3
        dact = _rows(plan, quant.quantize_rows(dy), quantize_weight(w2.transpose(1, 2)), dt, ctx.backend,
                     token=plan.token_R)
        dpreact, act_scaled = torch.empty_like(preact), torch.empty_like(dact)
        dtopk_w = stages.act_bwd(plan, dact, preact, topk_w, dpreact, act_scaled, ctx.activation,
                                 interleaved=ctx.interleaved)
        del dact, preact
        if ctx.dropped:
            dtopk_w = clear_dropped(plan, dtopk_w, act_scaled, dpreact)
        dw2 = stages.weight_grad(plan, dy, act_scaled, torch.empty_like(w2), True, ctx.backend)
        del act_scaled
        dw1 = stages.weight_grad(plan, dpreact, x, torch.empty_like(w1), False, ctx.backend)
        dx_rows = _rows(plan, quant.quantize_rows(dpreact), quantize_weight(w1.transpose(1, 2)), dt,
                        ctx.backend)  # dX~ = dH W1
        dx = stages.combine(plan, dx_rows, None, dt)
        return dx, dw1, dw2, dtopk_w, *(None,) * 9


def fp8_experts(x, routing: RoutingIndex, topk_w, w1, w2, activation, checkpoint, backend, interleaved):
    return Fp8Experts.apply(x, w1, w2, topk_w, *routing.tensors(), activation, checkpoint, routing.dropped,
                            interleaved, backend)
