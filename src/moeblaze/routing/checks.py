"""Input checks shared by the router, the index builders and the expert layers.

Shape, dtype and device checks are free (metadata only) and always run. Value checks (expert ids in
range, no duplicate expert per token, finite router weights) read tensor data: on the CPU they raise
ValueError at once; on an accelerator, or inside torch.compile, they become device-side asserts
(torch._assert_async) so that the layer never synchronizes with the host, and a bad value still stops
the program instead of producing a wrong answer.
"""
from __future__ import annotations

import numbers

import torch

from ..configs import check_layer


DEVICE_MESSAGE_BYTES = 254  # the longest message a CUDA device-side assert takes (torch._assert_async refuses more)


def device_message(message: str) -> str:
    """message, checked to fit a device-side assert on every device (so that a CPU test finds one a GPU would
    refuse at the call)."""
    if len(message.encode()) > DEVICE_MESSAGE_BYTES:
        raise RuntimeError(f"internal: a device-side assert's message is over {DEVICE_MESSAGE_BYTES} bytes: "
                           f"{message!r}")
    return message


def fail_if(bad: torch.Tensor, message: str, error: type[Exception] = ValueError) -> None:
    """Raise `error` (CPU, eager) or assert on the device (accelerators, compile) when `bad` holds True; message at
    most DEVICE_MESSAGE_BYTES bytes."""
    device_message(message)
    if bad.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(bad):
            raise error(message)
    else:
        torch._assert_async(~bad, message)


def check_num_experts(num_experts) -> int:
    if not isinstance(num_experts, (numbers.Integral, torch.SymInt)) or isinstance(num_experts, bool):
        raise TypeError(f"num_experts must be an int, got {num_experts!r} ({type(num_experts).__name__})")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    return num_experts if isinstance(num_experts, (int, torch.SymInt)) else int(num_experts)


def check_topk_idx(topk_idx_LK: torch.Tensor, num_experts: int, check_values: bool = True) -> None:
    if not isinstance(topk_idx_LK, torch.Tensor):
        raise TypeError(f"topk_idx must be a tensor, got {type(topk_idx_LK).__name__}")
    if topk_idx_LK.dim() != 2:
        raise ValueError(f"topk_idx must have shape (L, K), got shape {tuple(topk_idx_LK.shape)}")
    if topk_idx_LK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int32 or int64, got {topk_idx_LK.dtype}")
    check_num_experts(num_experts)
    K = topk_idx_LK.shape[1]
    if K < 1:
        raise ValueError(f"topk_idx must hold at least one expert per token, got shape {tuple(topk_idx_LK.shape)}")
    check_layer(num_experts, K)
    if not check_values or topk_idx_LK.numel() == 0:
        return
    fail_if(((topk_idx_LK < 0) | (topk_idx_LK >= num_experts)).any(),
             f"topk_idx holds an expert id outside [0, {num_experts})")
    if K > 1:
        srt = topk_idx_LK.sort(dim=1).values
        fail_if((srt[:, 1:] == srt[:, :-1]).any(), "topk_idx routes a token to the same expert twice")


def check_topk_weights(topk_w_LK: torch.Tensor, topk_idx_LK: torch.Tensor, check_values: bool = True) -> None:
    if not isinstance(topk_w_LK, torch.Tensor):
        raise TypeError(f"topk_weights must be a tensor, got {type(topk_w_LK).__name__}")
    if topk_w_LK.shape != topk_idx_LK.shape:
        raise ValueError(f"topk_weights shape {tuple(topk_w_LK.shape)} must equal topk_idx shape "
                         f"{tuple(topk_idx_LK.shape)}")
    if not topk_w_LK.is_floating_point():
        raise TypeError(f"topk_weights must be a float tensor, got {topk_w_LK.dtype}")
    if topk_w_LK.device != topk_idx_LK.device:
        raise ValueError(f"topk_weights is on {topk_w_LK.device} but topk_idx is on {topk_idx_LK.device}")
    if check_values and topk_w_LK.numel():
        fail_if(~torch.isfinite(topk_w_LK).all(), "topk_weights holds NaN or Inf")


def _w1_parts(w1, activation: str, interleaved) -> tuple:
    """W1 as its parts: (w1,) for one tensor (E, F, D), (gate rows, up rows) for a pair of one shape (E, H, D),
    which a gated activation with gate/up in halves takes; ValueError otherwise."""
    from ..reference import is_gated

    parts = (w1,) if isinstance(w1, torch.Tensor) else w1
    if (not isinstance(parts, tuple) or len(parts) != (1 if isinstance(w1, torch.Tensor) else 2)
            or not all(isinstance(p, torch.Tensor) and p.dim() == 3 for p in parts)):
        raise ValueError("w1 must be a tensor (E, F, D), or a pair of tensors (gate rows (E, H, D), up rows (E, H, D))")
    if len(parts) == 2:
        if parts[0].shape != parts[1].shape:
            raise ValueError(f"w1's gate and up parts must have one shape (E, H, D), got {tuple(parts[0].shape)} and "
                             f"{tuple(parts[1].shape)}")
        if not is_gated(activation) or interleaved:
            raise ValueError(f"w1 in two parts needs a gated activation with gate/up in halves, got {activation!r}"
                             + (" and interleaved=True" if interleaved else ""))
    return parts


def is_master(w: torch.Tensor, x_LD: torch.Tensor) -> bool:
    """Whether w is a float32 master weight of a half-precision x (bfloat16 or float16)."""
    return w.dtype == torch.float32 and x_LD.dtype in (torch.bfloat16, torch.float16)


def _check_dtypes_and_devices(x_LD: torch.Tensor, weights: tuple, biases: tuple, masters: bool) -> None:
    """The weights and biases ((name, tensor or None) pairs) on x's device, the biases in x's dtype, and the weights
    in x's dtype or, with masters, all float32 masters of a half-precision x: w1 (the first) sets their dtype."""
    masters = masters and is_master(weights[0][1], x_LD)
    for name, t, weight in [(*w, True) for w in weights] + [(*b, False) for b in biases]:
        if t is None:
            continue
        if weight and masters:
            if t.dtype != weights[0][1].dtype:
                raise TypeError(f"{name} dtype {t.dtype} differs from w1's {weights[0][1].dtype}: float32 master "
                                "weights come all in float32")
        elif t.dtype != x_LD.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from x dtype {x_LD.dtype}"
                            + (" (float32 master weights of bfloat16 or float16 x, all of them, are taken under "
                               "precision='fp8')" if weight and is_master(t, x_LD) else ""))
        if t.device != x_LD.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x_LD.device}")


def check_expert_inputs(x_LD: torch.Tensor, w1_EFD: torch.Tensor, w2_EDH: torch.Tensor, activation: str,
                        b1_EF: torch.Tensor | None = None, b2_ED: torch.Tensor | None = None,
                        interleaved: bool = False, masters: bool = False) -> None:
    """Shapes, dtypes and devices of the expert computation's dense inputs (and its optional biases). w1 may be
    a pair (gate rows (E, H, D), up rows (E, H, D)) for a gated activation. masters: the weights may also be
    float32 master weights of a bfloat16 or float16 x (precision="fp8")."""
    from ..reference import is_gated, up_width

    if x_LD.dim() != 2:
        raise ValueError(f"x must have shape (L, D), got shape {tuple(x_LD.shape)}")
    parts = _w1_parts(w1_EFD, activation, interleaved)
    w1_EFD = parts[0]
    if w1_EFD.dim() != 3 or w2_EDH.dim() != 3:
        raise ValueError(f"w1 must be (E, F, D) and w2 (E, D, H); got {tuple(w1_EFD.shape)} and {tuple(w2_EDH.shape)}")
    E, F, D = w1_EFD.shape
    F *= len(parts)
    E2, D2, H = w2_EDH.shape
    if D != x_LD.shape[1] or D2 != D:
        raise ValueError(f"hidden size mismatch: x has D={x_LD.shape[1]}, w1 has D={D}, w2 has D={D2}")
    if E2 != E:
        raise ValueError(f"expert count mismatch: w1 has E={E}, w2 has E={E2}")
    if F != up_width(activation, H):
        raise ValueError(f"w1 must have {up_width(activation, H)} rows per expert for activation {activation!r} "
                         f"with H={H} (gate rows first for gated activations), got {F}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    if interleaved and not is_gated(activation):
        raise ValueError(f"interleaved gate/up rows need a gated activation, got {activation!r}")
    for name, b, shape in (("b1", b1_EF, (E, F)), ("b2", b2_ED, (E, D))):
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != shape):
            raise ValueError(f"{name} must be a tensor of shape {shape} (E, {'F' if name == 'b1' else 'D'}), got "
                             f"{tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
    _check_dtypes_and_devices(x_LD, (("w1", w1_EFD), ("w1's up part", parts[-1]), ("w2", w2_EDH)),
                              (("b1", b1_EF), ("b2", b2_ED)), masters)
    if not x_LD.is_floating_point():
        raise TypeError(f"x must be a float tensor, got {x_LD.dtype}")
