"""The experts op: `moe_experts`, the functional MoE expert computation over the reference or the fused kernels.

Package map: autograd (custom ops and autograd over the stages), stages (the documented stage API), dispatch
(which backend runs each launch), schedule (the device-built tile schedule), launch (the light launch path),
tl/ (the portable Triton kernels), gluon_sm90/ (the Hopper warp-specialised kernels).

Memory contract: see experts.autograd (the pre-activation under checkpoint="preact", in e4m3 under "preact-fp8",
nothing but the routing index and the tile schedule under "recompute"); chunk_tokens bounds every transient by a
token chunk.
"""
from __future__ import annotations

import torch

from ..config import INTERPRET
from ..reference import check_activation, moe_experts_reference
from ..routing import RoutingIndex, build_routing_index, check_expert_inputs, check_topk_weights
from .autograd import fused_experts
from .dispatch import BACKENDS, check_backend, launch_counts, resolve
from .fp8 import PRECISIONS, check_fp8_supported, fp8_experts

CHECKPOINTS = ("preact", "recompute", "preact-fp8")
IMPLS = ("auto", "triton", "reference")


def resolve_impl(impl: str, device: torch.device) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return impl


def moe_experts(x: torch.Tensor, routing: RoutingIndex, topk_weights: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, activation: str = "swiglu", checkpoint: str = "preact", impl: str = "auto",
                check: bool = True, chunk_tokens: int | None = None, backend: str = "auto",
                b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                interleaved: bool = False, precision: str = "native", fp8_weight_cache: bool = False,
                fp8_wgrad: bool = False) -> torch.Tensor:
    """Combined expert outputs (L, D) for tokens x (L, D) routed by `routing` with weights (L, K).

    w1: (E, F, D), F = 2H with the gate rows first (or, where `interleaved`, gate and up rows alternating, gate
    first) for gated activations, F = H for plain ones; w2: (E, D, H); any strides (a transposed view is read in
    place). b1 (E, F), b2 (E, D): optional biases of the two projections, in w1's and w2's row order.
    Differentiable in x, w1, w2, topk_weights and the biases. checkpoint: "preact" keeps the pre-activation for
    backward, "recompute" keeps nothing beyond the routing index (Triton only; the reference keeps everything
    autograd needs), "preact-fp8" keeps the pre-activation in e4m3 with one fp32 scale per 1 x 128 group
    (reference.fp8; about half the bytes of "preact"), which backward reads back: the forward is exact, the
    gradients come from the pre-activation as fp8 holds it. impl: "triton", "reference" or "auto" (Triton on CUDA,
    the reference elsewhere). backend (Triton only): "auto" (the Gluon kernels on Hopper, the tl kernels elsewhere),
    "tl" or "gluon" (see experts.dispatch). chunk_tokens: run the Triton experts on chunks of this many tokens, each
    with its own routing index, so that the transient (L·K, D) and (L·K, F) buffers of forward and backward scale
    with the chunk instead of L (for millions of tokens; the weights are read once per chunk, and the outputs and dx
    are concatenated). precision: "native" (the GEMMs in the inputs' dtype) or "fp8" (the four data GEMMs on e4m3
    operands with 1 x 128 / 128 x 128 scales, weight gradients in the inputs' dtype: experts.fp8; on the reference,
    its emulation). fp8_weight_cache (precision="fp8"): keep each weight's e4m3 copies, both layouts, until the
    weight changes (its version counter: an optimizer step), instead of quantizing where used:
    forward and backward, and every micro-batch of an accumulated step, share one quantization, for the copies'
    bytes (half the weights' in bf16) held between steps (experts.fp8). fp8_wgrad (precision="fp8"): the weight
    gradients on e4m3 operands too, each scaled per 128 of an expert's rows (DeepSeek-V3's 128 x 1 groups; a Gluon
    kernel on Hopper, the portable tl kernel elsewhere).
    """
    check_activation(activation)
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {checkpoint!r}")
    check_backend(backend)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if fp8_weight_cache and precision != "fp8":
        raise ValueError(f"fp8_weight_cache keeps e4m3 weights for precision='fp8'; precision is {precision!r}")
    if fp8_wgrad and precision != "fp8":
        raise ValueError(f"fp8_wgrad takes the weight gradients to e4m3 past precision='fp8'; precision is "
                         f"{precision!r}")
    check_expert_inputs(x, w1, w2, activation, b1, b2, interleaved)
    if routing.num_tokens != x.shape[0] or routing.num_experts != w1.shape[0]:
        raise ValueError(f"routing index is for L={routing.num_tokens}, E={routing.num_experts}; "
                         f"x has L={x.shape[0]} and w1 has E={w1.shape[0]}")
    if routing.token_slot.device != x.device:
        raise ValueError(f"routing index is on {routing.token_slot.device} but x is on {x.device}")
    check_topk_weights(topk_weights, routing.token_slot, check_values=check)
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive number of tokens, got {chunk_tokens}")
    impl = resolve_impl(impl, x.device)
    if impl == "reference":
        return moe_experts_reference(x, routing.topk_idx(), topk_weights, w1, w2, activation, b1, b2, interleaved,
                                     preact_fp8=checkpoint == "preact-fp8", fp8_gemms=precision == "fp8",
                                     fp8_wgrad=fp8_wgrad)
    if x.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"impl='triton' needs a CUDA GPU (x is on {x.device}), or Triton's CPU interpreter: set "
                           "TRITON_INTERPRET=1 before importing moeblaze (or triton); impl='auto' runs the PyTorch "
                           "reference off CUDA")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the Triton experts take float16, bfloat16 or float32, got {x.dtype}")
    backend = resolve(backend, x.device)
    if precision == "fp8":
        check_fp8_supported(x, b1, b2, chunk_tokens)
        return fp8_experts(x, routing, topk_weights, w1, w2, activation, checkpoint, backend, interleaved,
                           fp8_weight_cache, fp8_wgrad)
    save, fp8 = checkpoint in ("preact", "preact-fp8"), checkpoint == "preact-fp8"
    if chunk_tokens is not None and x.shape[0] > chunk_tokens:
        idx, E = routing.topk_idx(), w1.shape[0]  # dropped pairs come back as id E: sentinels again
        outs = [fused_experts(xc, w1, w2, wc, b1, b2, *build_routing_index(ic, E, check=False,
                                                                           sentinels=routing.dropped).tensors(),
                              activation, save, backend, routing.dropped, interleaved, fp8)
                for xc, ic, wc in zip(x.split(chunk_tokens), idx.split(chunk_tokens), topk_weights.split(chunk_tokens))]
        return torch.cat(outs)
    return fused_experts(x, w1, w2, topk_weights, b1, b2, *routing.tensors(), activation, save, backend,
                         routing.dropped, interleaved, fp8)


__all__ = ["BACKENDS", "CHECKPOINTS", "IMPLS", "PRECISIONS", "check_backend", "launch_counts", "moe_experts",
           "resolve_impl"]
