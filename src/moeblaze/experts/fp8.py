"""precision="fp8": the GEMM strategy (Fp8Gemms) of the experts op (experts.op) with its four data GEMMs on e4m3
operands (DeepSeek-V3's recipe, reference.fp8's quantizers): the arithmetic of the reference's emulation
(moe_experts_reference with ExpertsConfig(precision="fp8")) on the kernels, every quantization one pass
(experts.quant).
Each fp8 GEMM (the kernel backends' fp8_rows stage, fp8_rows_gemm below) runs on the Hopper kernel
(gluon_sm90.fp8) where experts.dispatch finds it takes its operands, on the portable one (tl.fp8) elsewhere.

Forward:   x_q = q(x) by token;  H = x_q[token] · q(W1[e])ᵀ (+ b1[e])   (fp8_rows_gemm, gathered; the bias a pass)
           q(A) = q(SiLU(gate)·up) from H in one pass (other activations: act(H) in torch, then q); under
           "preact-fp8" the same pass quantizes the kept H
           Y = q(A) · q(W2[e])ᵀ                                (fp8_rows_gemm)
           out = combine(w · (Y + b2))                          (stages.combine, fp32 sums)
Backward:  dA' = q(dy)[token] · q(W2[e]ᵀ)ᵀ                      (fp8_rows_gemm, gathered; q(W2ᵀ) written K-major
                                                                 from W2 in one pass: the same 128 x 128 blocks)
           dH, s·A, dS from dA' and H; q(dH) as dH is stored     (stages.act_bwd)
           dW2 = dy[token]ᵀ (s·A), dW1 = dHᵀ x[token]           (stages.weight_grad, input precision)
           dB1, dB2 and dS's bias term                           (stages.bias_grads, input precision)
           dX~ = q(dH) · q(W1[e]ᵀ)ᵀ; dx = combine(dX~)           (fp8_rows_gemm, stages.combine)
q: quantize_rows for activations and gradients (1 x 128 groups), quantize_blocks for weights (128 x 128).

Memory contract: as experts.op's for the same checkpoint (H under "preact", in e4m3 under "preact-fp8", read
back by the dH pass as it loads it, recomputed by the fp8 up GEMM under "recompute"); transient: x_q, q(A), q(dy),
q(dH) and the weights' e4m3 copies.
By default the weights are quantized where they are used, forward and backward, never kept between them: under
FSDP2 the gathered weights are freed after forward, and a copy kept for backward would hold them (in e4m3) through
the step. With ExpertsConfig(fp8_weight_cache=True) each weight is quantized once in both layouts
(quant.quantize_blocks(both=True)), and the pair is kept (E·(F·D + D·H) · 2 bytes and their scales, per layer)
until the weight changes: its version counter moves on with every in-place update (an optimizer's loop or foreach
step, a no_grad copy_, load_state_dict), and every torch.optim optimizer's step forgets the pairs of its parameters
(its fused kernels write without moving the counters), so forward and backward of a
micro-batch, and every micro-batch of an accumulated step, share one quantization (weight_pair). A write that
bypasses both is not seen: through `.data`, by an optimizer outside torch.optim, or FSDP2's all-gather into its
gathered weights (distributed.parallelize refuses the cache there); clear_weight_cache says which, and forgets the
copies. On CUDA it needs fp8 tensor cores (sm_89 or later).
"""
from __future__ import annotations

import weakref

import torch

from ..reference import apply_activation
from ..reference.fp8 import FP8, GROUP
from . import dispatch, stages, tl
from .stages import RowPlan
from . import quant


def check_fp8_supported(x: torch.Tensor) -> None:
    """Raise where precision="fp8" cannot run on x's device."""
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 9):
        raise RuntimeError(f"precision='fp8' needs fp8 tensor cores (sm_89 or later); "
                           f"{torch.cuda.get_device_name(x.device)} has none: use precision='native'")


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


def clear_weight_cache(weight: torch.Tensor | None = None) -> None:
    """Forget the e4m3 copies of `weight` (default: of every weight), so that the next use quantizes it again. The
    cache sees every write that moves the weight's version counter: in-place ops on it or on a view of it, an
    optimizer step (a torch.optim optimizer's step also forgets its parameters' copies: its fused kernels move no
    counter), load_state_dict. It can't see writes that bypass the counter: FSDP2's all-gather, through
    `weight.data` (`param.data.copy_(...)`, as some loaders and EMA code write), `set_`, an optimizer outside
    torch.optim, or a kernel or collective writing the storage outside autograd; after such a write, call this.

    Args:
        weight: a weight tensor (None: every cached weight).

    Returns:
        None.
    """
    if weight is None:
        _PAIRS.clear()
    else:
        _PAIRS.pop(id(weight), None)


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
    _watch_optimizers()
    return pair, pair_t


_HOOK = []  # the global optimizer hook, once registered


def _forget_stepped(optimizer, args, kwargs) -> None:
    """After any torch.optim optimizer's step: forget the pairs of the parameters it holds. The fused optimizers
    (AdamW(fused=True), Adam, SGD: one kernel over every parameter) write in place without moving the version
    counters, which the signature can't see."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _PAIRS.get(id(p))
            if entry is not None and entry[0]() is p:
                del _PAIRS[id(p)]


def _watch_optimizers() -> None:
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_forget_stepped))


def _weight(w_ENK: torch.Tensor, cache: bool, transposed: bool = False):
    """q(W) (or q(Wᵀ) where transposed): from the cache (weight_pair) or quantized here (also for an inference
    tensor, which has no version counter to check a copy against)."""
    if cache and not w_ENK.is_inference():
        return weight_pair(w_ENK)[1 if transposed else 0]
    return quantize_weight(w_ENK.transpose(1, 2) if transposed else w_ENK)


def _rows(plan: RowPlan, a_q, w_q, out_dtype, backend, token=None):
    """C[rows] = q(A)[token[rows] if token is given, else rows] · q(W[e])ᵀ: (a_q, a_scale), (w_q, w_scale); on the
    Hopper kernel where it takes the operands (experts.dispatch), else on tl."""
    return dispatch.launch("fp8_rows", backend, a_q[0].device, plan, a_q, w_q, out_dtype, token)


def _act_quantized(preact, activation, interleaved):
    """q(act(H)) in 1 x 128 groups: one pass from H for SwiGLU, act in torch and then one pass otherwise."""
    if activation == "swiglu":
        return quant.swiglu_quantize(preact, interleaved)
    return quant.quantize_rows(apply_activation(preact, activation, interleaved))


def _add_bias(preact_RF: torch.Tensor, b1_EF, plan: RowPlan) -> torch.Tensor:
    """preact + b1[e] of each row's expert e, in place (rows past the last expert's end, dropped pairs, take the
    last expert's bias: they are never read)."""
    if b1_EF is None:
        return preact_RF
    E = b1_EF.shape[0]
    rows = torch.arange(preact_RF.shape[0], device=preact_RF.device, dtype=plan.offsets_E1.dtype)
    e_R = torch.searchsorted(plan.offsets_E1[1:], rows, right=True).clamp_(max=E - 1)
    return preact_RF.add_(b1_EF[e_R].to(preact_RF.dtype))


class Fp8Gemms:
    """The GEMM strategy of precision="fp8" (the module header); its methods mirror experts.op.NativeGemms."""

    def __init__(self, r):
        self.r = r

    def preact(self, plan: RowPlan, x_LD, inputs):
        """H = q(x)[token] · q(W1[e])ᵀ (+ b1[e]); W1 in two parts concatenated first (a transient copy)."""
        r = self.r
        h = _rows(plan, quant.quantize_rows(x_LD), _weight(inputs.whole_w1, r.fp8_weight_cache), x_LD.dtype,
                  r.backend, token=plan.token_R)
        return _add_bias(h, inputs.b1, plan)

    def up(self, plan: RowPlan, x_LD, inputs, keep: bool):
        """(H, q(act(H)), q(H) where the activation's pass made it (SwiGLU under "preact-fp8"), else None); W1 in
        two parts is concatenated first (a transient copy), then quantized."""
        r = self.r
        preact = self.preact(plan, x_LD, inputs)
        if r.checkpoint == "preact-fp8" and r.activation == "swiglu":
            act_q, kept_q = quant.swiglu_quantize(preact, r.interleaved, keep_preact=True)
            return preact, act_q, kept_q
        return preact, _act_quantized(preact, r.activation, r.interleaved), None

    def down(self, plan: RowPlan, act_q, w2_EDH, dtype: torch.dtype):
        """Y = q(A) · q(W2[e])ᵀ in dtype."""
        r = self.r
        return _rows(plan, act_q, _weight(w2_EDH, r.fp8_weight_cache), dtype, r.backend)

    def dact(self, plan: RowPlan, dy_LD, w2_EDH, preact_RF, preact_scale, topk_w_LK, overwrite: bool):
        """(dH, s·A, dS, q(dH) where the dH pass made it): dA' = q(dy)[token] · q(W2ᵀ), then s·A over dA' in place
        (the pass reads each element before it writes it), and dH over a bf16 preact where overwrite allows; q(dH)
        for dX~, written by the dH pass as it stores dH where it can (not with dropped rows, whose dH is cleared
        after): the same peak as dA' and s·A apart with q(dH) made later, one read of dH fewer. H in e4m3 is read
        back by the dH pass as it loads it."""
        r, dt = self.r, dy_LD.dtype
        dact = _rows(plan, quant.quantize_rows(dy_LD), _weight(w2_EDH, r.fp8_weight_cache, transposed=True), dt,
                     r.backend, token=plan.token_R)
        dpreact = preact_RF if overwrite else torch.empty(preact_RF.shape, dtype=dt, device=dy_LD.device)
        dpreact_q = None
        if not r.dropped and tl.dh_quantizable(dact.shape[1], r.activation, r.interleaved):
            F = preact_RF.shape[1]
            dpreact_q = (torch.empty(preact_RF.shape, dtype=FP8, device=dy_LD.device),
                         torch.empty(preact_RF.shape[0], -(-F // GROUP), dtype=torch.float32, device=dy_LD.device))
        dtopk_w = stages.act_bwd(plan, dact, preact_RF, topk_w_LK, dpreact, dact, r.activation,
                                 interleaved=r.interleaved, preact_scale=preact_scale, dpreact_q=dpreact_q)
        return dpreact, dact, dtopk_w, dpreact_q

    def dx_rows(self, plan: RowPlan, dpreact_RF, dpreact_q, inputs):
        """dX~ = q(dH) · q(W1[e]ᵀ)ᵀ."""
        r = self.r
        dpreact_q = dpreact_q if dpreact_q is not None else quant.quantize_rows(dpreact_RF)
        return _rows(plan, dpreact_q, _weight(inputs.whole_w1, r.fp8_weight_cache, transposed=True),
                     dpreact_RF.dtype, r.backend)
