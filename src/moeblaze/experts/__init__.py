"""The experts op: `moe_experts`, the functional MoE expert computation over the reference or the fused kernels.

Package map: op (the op declared over its bodies, written once over a GEMM strategy), fp8 (the e4m3 strategy and its
weight cache), quant (the one-pass e4m3 quantizers every backend uses), stages (the documented stage API), backends
(the kernel backends by name, each with its operand checks), dispatch (which backend runs each launch), schedule
(the device-built tile schedule and the row plan), tl/ (the portable Triton kernels), gluon_sm90/ (the Hopper
warp-specialised kernels). routed_call is the one call every host (nn, distributed, the integrations) makes.

Memory contract: see experts.op (the pre-activation under checkpoint="preact", in e4m3 under "preact-fp8",
nothing but the routing index and the tile schedule under "recompute"); chunk_tokens bounds every transient by a
token chunk.
"""
from __future__ import annotations

import functools

import torch

from ..configs import DEFAULT, ExpertsConfig, from_legacy
from ..reference import moe_experts_reference
from ..routing import RoutingIndex, build_routing_index
from ..routing.checks import check_expert_inputs, check_topk_weights
from .dispatch import choose, launch_counts
from .fp8 import check_fp8_supported, clear_weight_cache
from .op import OpInputs, OpKey, fused_experts
from .schedule import whole_w1

def check_kernel_dtype(x: torch.Tensor) -> None:
    """TypeError unless the kernels compute x's dtype right where x is: float16, bfloat16 or float32, and under
    Triton's CPU interpreter not bfloat16 (the interpreter's bf16 dot products are wrong by orders of magnitude)."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the Triton experts take float16, bfloat16 or float32, got {x.dtype}")
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        raise TypeError("bfloat16 on the kernels under Triton's CPU interpreter: the interpreter computes bf16 dot "
                        "products wrongly; use float32 or float16 on the CPU, or backend='reference'")


def autocast_operands(*tensors: torch.Tensor | None) -> tuple:
    """The experts' operands as they compute: in autocast's dtype where autocast is on for the first one's device
    (like nn.Linear), else as given; None stays None."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def autocast_weights(config: ExpertsConfig, *weights: torch.Tensor | None) -> tuple:
    """The expert weights as a call takes them: as autocast_operands casts them (like nn.Linear's), except under
    precision="fp8", where float32 ones stay float32 (master weights, the parameters themselves): the call casts them
    where it runs native GEMMs, and where it runs e4m3 the quantizers read them as they lie, so no half-precision
    copy is made for it or kept to backward (and fp8_weight_cache can key on the parameter).

    Args:
        config: the experts' moeblaze.ExpertsConfig.
        *weights: the expert weights (tensors or None), as the module holds them.

    Returns:
        The weights in the same order: cast to autocast's dtype where autocast is on and the call does not take
        them as float32 masters, else as given.
    """
    if config.fp8 and all(w is None or w.dtype == torch.float32 for w in weights):
        return weights
    return autocast_operands(*weights)


def call_weights(e4m3: bool, x: torch.Tensor, *weights: torch.Tensor | None) -> tuple:
    """The weights a call computes with: float32 masters of a half-precision x cast to x's dtype (differentiably:
    their gradients come back in float32) unless the call runs e4m3 GEMMs, which quantize them as they are."""
    if e4m3:
        return weights
    return tuple(None if w is None else w.to(x.dtype) for w in weights)


def kernel_op_key(x: torch.Tensor, config: ExpertsConfig, backend: str, dropped: bool, interleaved: bool, *,
                  call: tuple[int, int, int]) -> str:
    """The op's key for the kernels on x (op_key) of a call of (tokens, top_k, experts) (ExpertsConfig.at_call:
    precision="fp8" where the experts get fp8_min_rows rows), after the checks they need: x's dtype, and fp8 tensor
    cores for precision="fp8" (whatever the call's size, so that a device without them is refused at once)."""
    check_kernel_dtype(x)
    if config.fp8:
        check_fp8_supported(x)
    return op_key(config.at_call(*call), backend, dropped, interleaved)


@functools.cache
def op_key(config: ExpertsConfig, backend: str, dropped: bool, interleaved: bool) -> str:
    """The op's key (experts.op.OpKey) of a call: config's choices that reach the kernels, on `backend` (the
    launches' backend, dispatch.choose), for an index with dropped pairs or not and W1's gate/up layout."""
    return OpKey(config.activation, config.checkpoint, backend, config.fp8, config.fp8_weight_cache, dropped,
                  interleaved).text


def moe_experts(x: torch.Tensor, routing: RoutingIndex, topk_weights: torch.Tensor,
                w1: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                w2: torch.Tensor, b1: torch.Tensor | None = None, b2: torch.Tensor | None = None, *,
                experts: ExpertsConfig = DEFAULT, interleaved: bool = False, check: bool = True,
                **legacy) -> torch.Tensor:
    """Combined expert outputs (L, D) for tokens x (L, D) routed by `routing` with weights topk_weights (L, K).

    w1: (E, F, D), F = 2H with the gate rows first (or, where `interleaved`, gate and up rows alternating, gate
    first) for gated activations, F = H for plain ones; w2: (E, D, H); any strides (a transposed view is read in
    place). b1 (E, F), b2 (E, D): optional biases of the two projections, in w1's and w2's row order. w1 may also
    come in two parts, (gate rows (E, H, D), up rows (E, H, D)), as torchtitan stores them: Hopper's kernels read
    them in place and write each part's gradient in place (bf16/fp16, H a multiple of 128); elsewhere (the portable
    kernels, precision="fp8") they are concatenated per call (a transient of W1's size, never kept).
    Differentiable in x, w1 (or its parts), w2, topk_weights and the biases. experts: the recipe
    (moeblaze.ExpertsConfig: activation, checkpoint policy, backend, precision, chunking); every combination it
    accepts runs here, on the kernels and on the reference (which keeps everything autograd needs, whatever the
    checkpoint policy, and emulates precision="fp8" and "preact-fp8"'s arithmetic). precision="fp8" runs e4m3
    GEMMs where the call's experts average at least experts.fp8_min_rows rows, native ones below (both paths).
    check=False skips the checks that read values (a host sync). 0.1's keyword options (activation=, impl=, ...)
    still work, with a DeprecationWarning.

    Args:
        x: (L, D) tokens, float16, bfloat16 or float32 (float32 or float16 under Triton's CPU interpreter).
        routing: the RoutingIndex of the top-k expert ids (moeblaze.build_routing_index(topk_idx, E)).
        topk_weights: (L, K) router weights, any float dtype.
        w1: (E, F, D) in x's dtype, or the pair (gate rows (E, H, D), up rows (E, H, D)); under
            precision="fp8" also float32 master weights of a bfloat16 or float16 x (autocast_weights): cast per call
            where the call runs native GEMMs, quantized where they lie where it runs e4m3; their gradients in
            float32.
        w2: (E, D, H), in w1's dtype.
        b1, b2: optional biases of the up-projection (E, F) and of the down-projection (E, D), in x's dtype.
        experts: the recipe, a moeblaze.ExpertsConfig (keyword only; config=, its 0.2 name, works with a
            DeprecationWarning).
        interleaved: gate and up rows of w1 alternate (gpt-oss's layout).
        check: validate the routing and the weights' values (a host sync).

    Returns:
        (L, D) in x's dtype: sum over k of topk_weights[t, k] · expert(topk_idx[t, k])(x[t]).
    """
    if isinstance(b1, str):
        raise TypeError("moe_experts(x, routing, topk_weights, w1, w2, b1=None, b2=None, *, "
                        f"experts=ExpertsConfig(...)): the options go in experts, not positionally (got {b1!r} for b1)")
    config = from_legacy("moe_experts", experts, legacy)
    check_expert_inputs(x, w1, w2, config.activation, b1, b2, interleaved, masters=config.fp8)
    w1, w1_up = (w1, None) if isinstance(w1, torch.Tensor) else w1
    if routing.num_tokens != x.shape[0] or routing.num_experts != w1.shape[0]:
        raise ValueError(f"routing index is for L={routing.num_tokens}, E={routing.num_experts}; "
                         f"x has L={x.shape[0]} and w1 has E={w1.shape[0]}")
    if routing.token_slot.device != x.device:
        raise ValueError(f"routing index is on {routing.token_slot.device} but x is on {x.device}")
    check_topk_weights(topk_weights, routing.token_slot, check_values=check)
    backend = choose(config.backend, x.device)
    call = (*topk_weights.shape, w1.shape[0])
    w1, w1_up, w2 = call_weights(config.at_call(*call).fp8, x, w1, w1_up, w2)
    if backend == "reference":
        return moe_experts_reference(x, routing.topk_idx(), topk_weights, whole_w1(w1, w1_up), w2, b1, b2,
                                     experts=config, interleaved=interleaved)
    key = kernel_op_key(x, config, backend, routing.dropped, interleaved, call=call)
    chunk = config.chunk_tokens
    if chunk is not None and x.shape[0] > chunk:
        idx, E = routing.topk_idx(), w1.shape[0]  # dropped pairs come back as id E: sentinels again
        chunks = (OpInputs.of(xc, w1, w2, wc, build_routing_index(ic, E, check=False, sentinels=routing.dropped),
                              b1=b1, b2=b2, w1_up=w1_up)
                  for xc, ic, wc in zip(x.split(chunk), idx.split(chunk), topk_weights.split(chunk)))
        return torch.cat([fused_experts(c, key) for c in chunks])
    return fused_experts(OpInputs.of(x, w1, w2, topk_weights, routing, b1=b1, b2=b2, w1_up=w1_up), key)


def routed_call(x: torch.Tensor, topk_idx: torch.Tensor | None, topk_weights: torch.Tensor,
                   w1: torch.Tensor | tuple[torch.Tensor, torch.Tensor], w2: torch.Tensor,
                   b1: torch.Tensor | None = None, b2: torch.Tensor | None = None, *,
                   experts: ExpertsConfig = DEFAULT, routing: RoutingIndex | None = None, sentinels: bool = False,
                   interleaved: bool = False, across=None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The routed-experts call every host makes (nn.Experts, distributed.ExpertParallel, the transformers,
    torchtitan and Megatron integrations), written once: x and the biases in autocast's dtype where it is on (like
    nn.Linear), the weights as autocast_weights takes them, then the experts, and the result in out_dtype.

    Args:
        x: (L, D) tokens.
        topk_idx: (L, K) expert ids (None where routing is given).
        topk_weights: (L, K) router weights.
        w1, w2, b1, b2: as moe_experts takes them (this rank's experts under expert parallelism).
        experts: the recipe, a moeblaze.ExpertsConfig.
        routing: a prebuilt RoutingIndex (token rounding's) instead of one built from topk_idx.
        sentinels: ids >= the experts' count are pairs that add nothing (skipped) rather than errors.
        interleaved: gate and up rows of w1 alternate (gpt-oss's layout).
        across: expert parallelism: a callable (x, topk_idx, topk_weights, w1, w2) -> (L, D) that runs the experts
            across ranks (distributed.ep_experts bound to its group and EPConfig); None: this rank's experts on a
            routing index.
        out_dtype: the result's dtype (None: the dtype the experts computed in).

    Returns:
        (L, D): sum over k of topk_weights[t, k] · expert(topk_idx[t, k])(x[t]).
    """
    x_, b1, b2 = autocast_operands(x, b1, b2)
    parts = w1 if isinstance(w1, tuple) else (w1,)
    *parts, w2 = autocast_weights(experts, *parts, w2)
    w1 = tuple(parts) if len(parts) > 1 else parts[0]
    if across is not None:
        if b1 is not None or b2 is not None or routing is not None:
            raise NotImplementedError("expert biases or a prebuilt routing index under expert parallelism")
        out = across(x_, topk_idx, topk_weights, w1, w2)
    else:
        if routing is None:
            E = parts[0].shape[0]
            routing = build_routing_index(topk_idx, E, experts.index_method, check=False, sentinels=sentinels)
        out = moe_experts(x_, routing, topk_weights, w1, w2, b1, b2, experts=experts, interleaved=interleaved,
                          check=False)
    return out if out_dtype is None else out.to(out_dtype)


__all__ = ["ExpertsConfig", "autocast_weights", "clear_weight_cache", "launch_counts", "moe_experts",
           "routed_call"]
