"""precision="fp8": the experts with their four data GEMMs on e4m3 operands (DeepSeek-V3's recipe, reference.fp8's
quantizers), as an autograd op composed from stages: the arithmetic of reference.moe_experts_reference(fp8_gemms=True)
on the kernels, every quantization one pass (experts.tl.quant).
Each fp8 GEMM (fp8_rows_gemm below) runs on the Hopper kernel (gluon_sm90.fp8) where experts.dispatch takes
its operands, on the portable one (tl.fp8) elsewhere.

Forward:   x_q = q(x) by token;  H = x_q[token] · q(W1[e])ᵀ   (fp8_rows_gemm, gathered)
           q(A) = q(SiLU(gate)·up) from H in one pass (other activations: act(H) in torch, then q); under
           "preact-fp8" the same pass quantizes the kept H
           Y = q(A) · q(W2[e])ᵀ                                (fp8_rows_gemm)
           out = combine(w · Y)                                 (stages.combine, fp32 sums)
Backward:  dA' = q(dy)[token] · q(W2[e]ᵀ)ᵀ                      (fp8_rows_gemm, gathered; q(W2ᵀ) written K-major
                                                                 from W2 in one pass: the same 128 x 128 blocks)
           dH, s·A, dS from dA' and H; q(dH) as dH is stored     (stages.act_bwd)
           dW2 = dy[token]ᵀ (s·A), dW1 = dHᵀ x[token]           (stages.weight_grad, input precision; with
                                                                 fp8_wgrad on e4m3 operands scaled per 128 of an
                                                                 expert's rows: quant.quantize_tiles_t, then
                                                                 fp8_weight_grad: gluon_sm90.fp8 on Hopper,
                                                                 tl.fp8 elsewhere)
           dX~ = q(dH) · q(W1[e]ᵀ)ᵀ; dx = combine(dX~)           (fp8_rows_gemm, stages.combine)
q: quantize_rows for activations and gradients (1 x 128 groups), quantize_blocks for weights (128 x 128).

Memory contract: as experts.autograd's for the same checkpoint (H under "preact", in e4m3 under "preact-fp8", read
back by the dH pass as it loads it, recomputed by the fp8 up GEMM under "recompute"); transient: x_q, q(A), q(dy),
q(dH) and the weights' e4m3 copies.
By default the weights are quantized where they are used, forward and backward, never kept between them: under
FSDP2 the gathered weights are freed after forward, and a copy kept for backward would hold them (in e4m3) through
the step. With cache_weights (moe_experts(fp8_weight_cache=True)) each weight is quantized once in both layouts
(quant.quantize_blocks(both=True)), and the pair is kept (E·(F·D + D·H) · 2 bytes and their scales, per layer)
until the weight changes: its version counter moves on with every in-place update (an optimizer step; FSDP2's
all-gather into it), so forward and backward of a micro-batch, and every micro-batch of an accumulated step,
share one quantization, and no copy can go stale (weight_pair). Custom ops (what torch.compile traces) and an
autograd.Function over the same bodies (eager), as experts.autograd. Not yet: biases, chunk_tokens, expert
parallelism; these raise. On CUDA it needs fp8 tensor cores (sm_89 or later).
"""
from __future__ import annotations

import weakref

import torch

from ..launch import ensure_context
from ..reference import apply_activation
from ..reference.fp8 import FP8, GROUP
from ..routing import RoutingIndex
from . import dispatch, gluon_sm90, stages, tl
from .autograd import clear_dropped, eager_function
from .schedule import BLOCK_M, tile_schedule
from .stages import RowPlan
from .tl import quant
from .tl.fp8 import fp8_rows_gemm, fp8_weight_grad

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


def _transposed_view(w_ENK: torch.Tensor) -> bool:
    """W (E, N, K) is a transposed view: K-major storage of Wᵀ (as gpt-oss keeps W1 and W2, or backward's Wᵀ of a
    plain W), quantized from its storage as it lies."""
    return w_ENK.stride(2) != 1 and w_ENK.stride(1) == 1


def quantize_weight(w_ENK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q(W) (E, N, K) K-major and its 128 x 128 scales for W (E, N, K) in any layout: a transposed view is written
    K-major in one pass."""
    if _transposed_view(w_ENK):
        return quant.quantize_blocks(w_ENK.transpose(1, 2), transpose=True)
    return quant.quantize_blocks(w_ENK.contiguous())


_PAIRS: dict[int, tuple] = {}  # id(weight) -> (weakref to it, its signature, (q(W), q(Wᵀ)))


def _signature(w: torch.Tensor) -> tuple:
    """What a cached pair must still match: the storage, the view, and the version counter (moved on by every
    in-place write, autograd's own check that a saved tensor is unchanged)."""
    return w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w._version


def weight_pair(w_ENK: torch.Tensor) -> tuple:
    """(q(W), q(Wᵀ)), each (q, scales) K-major, for W (E, N, K) in any layout: quantized the
    first time, then kept while W is the same tensor at the same version (see the module header)."""
    key = id(w_ENK)
    entry = _PAIRS.get(key)
    if entry is not None and entry[0]() is w_ENK and entry[1] == _signature(w_ENK):
        return entry[2]
    if _transposed_view(w_ENK):
        pair_t, pair = quant.quantize_blocks(w_ENK.transpose(1, 2), both=True)
    else:
        pair, pair_t = quant.quantize_blocks(w_ENK.contiguous(), both=True)

    def forget(ref, key=key):  # the weight is gone: drop its pair (unless the key went to a newer weight)
        if _PAIRS.get(key, (None,))[0] is ref:
            del _PAIRS[key]
    _PAIRS[key] = (weakref.ref(w_ENK, forget), _signature(w_ENK), (pair, pair_t))
    return pair, pair_t


def _weight(w_ENK: torch.Tensor, cache: bool, transposed: bool = False):
    """q(W) (or q(Wᵀ) where transposed): from the cache (weight_pair) or quantized here (also for an inference
    tensor, which has no version counter to check a copy against)."""
    if cache and not w_ENK.is_inference():
        return weight_pair(w_ENK)[1 if transposed else 0]
    return quantize_weight(w_ENK.transpose(1, 2) if transposed else w_ENK)


def _rows(plan: RowPlan, a_q, w_q, out_dtype, backend, token=None):
    """C[rows] = q(A)[token[rows] if token is given, else rows] · q(W[e])ᵀ: (a_q, a_scale), (w_q, w_scale); on the
    Hopper kernel where experts.dispatch takes the operands, else on tl."""
    gemm = fp8_rows_gemm
    if dispatch.fp8_rows(backend, a_q[0], w_q[0], out_dtype) == "gluon":
        gemm = gluon_sm90.fp8_rows_gemm
    return gemm(*a_q, *w_q, plan.num_rows, plan.offsets_E1, plan.sched, token, out_dtype)


def _act_quantized(preact, activation, interleaved):
    """q(act(H)) in 1 x 128 groups: one pass from H for SwiGLU, act in torch and then one pass otherwise."""
    if activation == "swiglu":
        return quant.swiglu_quantize(preact, interleaved)
    return quant.quantize_rows(apply_activation(preact, activation, interleaved))


def fp8_experts_forward(x_LD: torch.Tensor, w1_EFD: torch.Tensor, w2_EDH: torch.Tensor, topk_w_LK: torch.Tensor,
                        counts: torch.Tensor, offsets: torch.Tensor, eti: torch.Tensor, slot: torch.Tensor,
                        activation: str, checkpoint: str, dropped: bool, interleaved: bool, backend: str,
                        cache_weights: bool = False, fp8_wgrad: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (L, D), H as backward keeps it (in x's dtype, e4m3 or empty by checkpoint), its scales (e4m3 only, else
    empty), *the tile schedule): the forward body (dropped is backward's, taken here for the autograd context)."""
    plan = RowPlan.build(RoutingIndex(counts, offsets, eti, slot))
    dt = x_LD.dtype
    kept_fp8 = None  # H in e4m3 and its scales, where quantized with A (one read of H for both)
    if x_LD.shape[0] == 0:
        out, preact = x_LD.new_zeros(x_LD.shape), x_LD.new_zeros(0, w1_EFD.shape[1])
    else:
        preact = _rows(plan, quant.quantize_rows(x_LD), _weight(w1_EFD, cache_weights), dt, backend,
                       token=plan.token_R)
        if checkpoint == "preact-fp8" and activation == "swiglu":
            act_q, kept_fp8 = quant.swiglu_quantize(preact, interleaved, keep_preact=True)
        else:
            act_q = _act_quantized(preact, activation, interleaved)
        y = _rows(plan, act_q, _weight(w2_EDH, cache_weights), dt, backend)
        out = stages.combine(plan, y, topk_w_LK.float().contiguous(), dt)
    kept, scale = preact, preact.new_empty(0, dtype=torch.float32)
    if checkpoint == "preact-fp8":
        kept, scale = kept_fp8 if kept_fp8 is not None else quant.quantize_rows(preact)
    elif checkpoint == "recompute":
        kept = preact.new_empty(0)
    return (out, kept, scale, *plan.sched)


fp8_experts_fwd = torch.library.custom_op("moeblaze::fp8_experts_fwd", fp8_experts_forward, mutates_args=())


@fp8_experts_fwd.register_fake
def _(x, w1, w2, topk_w, counts, offsets, eti, slot, activation, checkpoint, dropped, interleaved, backend,
      cache_weights=False, fp8_wgrad=False):
    R, F = (eti.shape[0], w1.shape[1]) if x.shape[0] else (0, w1.shape[1])
    tiles = eti.shape[0] // BLOCK_M + counts.shape[0]
    ints = dict(dtype=torch.int32, device=x.device)
    kept = {"preact": x.new_empty(R, F), "preact-fp8": x.new_empty(R, F, dtype=FP8)}.get(checkpoint, x.new_empty(0))
    scale = x.new_empty((R, -(-F // 128)) if checkpoint == "preact-fp8" else (0,), dtype=torch.float32)
    return (x.new_empty(x.shape), kept, scale, torch.empty(tiles, **ints), torch.empty(tiles, **ints),
            torch.empty(1, **ints))


def fp8_experts_backward(dy: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_w: torch.Tensor,
                         kept: torch.Tensor, scale: torch.Tensor, te: torch.Tensor, tr: torch.Tensor, tu: torch.Tensor,
                         offsets: torch.Tensor, eti: torch.Tensor, slot: torch.Tensor, activation: str,
                         checkpoint: str, dropped: bool, interleaved: bool, backend: str, cache_weights: bool = False,
                         fp8_wgrad: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw1, dw2, dtopk_w): the backward body."""
    if dy.is_cuda:  # autograd runs this on a thread of its own: TMA descriptors need its CUDA context current
        ensure_context(dy.get_device())
    if x.shape[0] == 0:
        return torch.zeros_like(x), torch.zeros_like(w1), torch.zeros_like(w2), torch.zeros_like(topk_w)
    plan = RowPlan(eti, offsets, slot, te, tr, tu)
    dt = x.dtype
    preact, preact_scale = kept, None  # H in e4m3 ("preact-fp8") is read back by the dH pass as it loads it
    if checkpoint == "recompute":
        preact = _rows(plan, quant.quantize_rows(x), _weight(w1, cache_weights), dt, backend, token=plan.token_R)
    elif checkpoint == "preact-fp8":
        preact_scale = scale
    # dA' = dy[token] W2, e4m3
    dact = _rows(plan, quant.quantize_rows(dy), _weight(w2, cache_weights, transposed=True), dt, backend,
                 token=plan.token_R)
    # s·A over dA' in place (the pass reads each element before it writes it); q(dH) for dX~, written by the dH
    # pass as it stores dH where it can (not with dropped rows, whose dH is cleared after): the same peak as
    # dA' and s·A apart with q(dH) made later, one read of dH fewer
    dpreact, act_scaled = torch.empty(preact.shape, dtype=dt, device=dy.device), dact
    dpreact_q = None
    if not dropped and tl.dh_quantizable(dact.shape[1], activation, interleaved):
        F = preact.shape[1]
        dpreact_q = (torch.empty(preact.shape, dtype=FP8, device=dy.device),
                     torch.empty(preact.shape[0], -(-F // GROUP), dtype=torch.float32, device=dy.device))
    dtopk_w = stages.act_bwd(plan, dact, preact, topk_w, dpreact, act_scaled, activation, interleaved=interleaved,
                             preact_scale=preact_scale, dpreact_q=dpreact_q)
    del dact, preact
    if dropped:
        dtopk_w = clear_dropped(plan, dtopk_w, act_scaled, dpreact)
    if fp8_wgrad:
        dw2, dw1 = _fp8_weight_grads(plan, dy, act_scaled, dpreact, x, w1, w2, backend)
        del act_scaled
    else:
        dw2 = stages.weight_grad(plan, dy, act_scaled, torch.empty_like(w2), True, backend)
        del act_scaled
        dw1 = stages.weight_grad(plan, dpreact, x, torch.empty_like(w1), False, backend)
    dpreact_q = dpreact_q if dpreact_q is not None else quant.quantize_rows(dpreact)
    dx_rows = _rows(plan, dpreact_q, _weight(w1, cache_weights, transposed=True), dt, backend)  # dX~ = dH W1
    return stages.combine(plan, dx_rows, None, dt), dw1, dw2, dtopk_w


def _fp8_weight_grads(plan: RowPlan, dy, act_scaled, dpreact, x, w1, w2, backend):
    """(dW2, dW1) on e4m3 operands (fp8_wgrad): dW2 = q(dy[rows])ᵀ q(s·A), dW1 = q(dH)ᵀ q(x[rows]), each operand
    quantized per 128 of an expert's rows (reference: moe_experts_reference(fp8_wgrad=True)), in the weights'
    layouts; on the Hopper kernel where experts.dispatch takes the operands, else on tl."""
    counts = plan.offsets_E1[1:] - plan.offsets_E1[:-1]
    sched = tile_schedule(counts, plan.offsets_E1, plan.num_rows, GROUP)

    def grad(p, q, w, gather_p):
        pt = quant.quantize_tiles_t(p, sched, plan.offsets_E1, plan.token_R if gather_p else None)
        qt = quant.quantize_tiles_t(q, sched, plan.offsets_E1, None if gather_p else plan.token_R)
        dw = torch.empty(w.shape, dtype=w.dtype, device=w.device)
        gemm = fp8_weight_grad
        if dispatch.fp8_weight_grad(backend, pt, qt, dw) == "gluon":
            gemm = gluon_sm90.fp8_weight_grad
        dw = gemm(pt, qt, plan.offsets_E1, dw)
        return dw if dw.stride() == w.stride() else torch.empty_like(w).copy_(dw)
    return grad(dy, act_scaled, w2, True), grad(dpreact, x, w1, False)


fp8_experts_bwd = torch.library.custom_op("moeblaze::fp8_experts_bwd", fp8_experts_backward, mutates_args=())


@fp8_experts_bwd.register_fake
def _(dy, x, w1, w2, topk_w, kept, scale, te, tr, tu, offsets, eti, slot, activation, checkpoint, dropped,
      interleaved, backend, cache_weights=False, fp8_wgrad=False):
    return x.new_empty(x.shape), torch.empty_like(w1), torch.empty_like(w2), topk_w.new_empty(topk_w.shape)


N_INPUTS = 15  # x, w1, w2, topk_w, the index's four tensors, activation, checkpoint, dropped, interleaved, backend,
# cache_weights, fp8_wgrad


def _setup_context(ctx, inputs, output):
    (x, w1, w2, topk_w, _counts, offsets, eti, slot, activation, checkpoint, dropped, interleaved, backend,
     cache_weights, fp8_wgrad) = inputs
    ctx.save_for_backward(x, w1, w2, topk_w, *output[1:], offsets, eti, slot)
    ctx.activation, ctx.checkpoint, ctx.dropped, ctx.interleaved = activation, checkpoint, dropped, interleaved
    ctx.backend, ctx.cache_weights, ctx.fp8_wgrad = backend, cache_weights, fp8_wgrad
    ctx.set_materialize_grads(False)  # the kept H and the schedule are saved state, never used downstream


def _backward_with(backward_fn):
    def backward(ctx, dout, *_saved_outputs):
        if dout is None:  # the output took no part in the loss
            return (None,) * N_INPUTS
        x, w1, w2, topk_w, kept, scale, te, tr, tu, offsets, eti, slot = ctx.saved_tensors
        grads = backward_fn(dout.contiguous(), x, w1, w2, topk_w, kept, scale, te, tr, tu, offsets, eti, slot,
                            ctx.activation, ctx.checkpoint, ctx.dropped, ctx.interleaved, ctx.backend,
                            ctx.cache_weights, ctx.fp8_wgrad)
        return (*grads, *(None,) * (N_INPUTS - 4))
    return backward


fp8_experts_fwd.register_autograd(_backward_with(fp8_experts_bwd), setup_context=_setup_context)


_EagerFp8Experts = eager_function("_EagerFp8Experts", fp8_experts_forward, _setup_context,
                                  _backward_with(fp8_experts_backward))


def fp8_experts(x, routing: RoutingIndex, topk_w, w1, w2, activation, checkpoint, backend, interleaved,
                cache_weights: bool = False, fp8_wgrad: bool = False):
    """The experts' output on e4m3 GEMMs: the custom op where torch.compile traces, the direct path in eager mode."""
    args = (x, w1, w2, topk_w, *routing.tensors(), activation, checkpoint, routing.dropped, interleaved, backend,
            cache_weights, fp8_wgrad)
    return (fp8_experts_fwd(*args) if torch.compiler.is_compiling() else _EagerFp8Experts.apply(*args))[0]
