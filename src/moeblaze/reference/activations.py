"""Expert activations, defined once for every implementation.

Gated activations split the up-projection output H (.., 2h) into gate and up columns and return
act(gate) * up: SwiGLU, GeGLU, and gpt-oss's clamped SwiGLU, (clamp(up, ±7) + 1) · g · σ(1.702 · g) with
g = min(gate, 7). The gate columns come first ([gate | up]), or, where `interleaved`, gate and up alternate
(gate at even columns, as gpt-oss stores them). Plain activations (SiLU, GELU, ReLU, squared ReLU) apply act
to H (.., h). GELU is the exact (erf) form, as torch.nn.functional.gelu's default.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..configs import ACTIVATIONS, GATED, PLAIN  # noqa: F401  (re-exported by reference)

CLAMP_LIMIT = 7.0  # clamped_swiglu: gate <= limit, -limit <= up <= limit (gpt-oss)
CLAMP_ALPHA = 1.702  # clamped_swiglu: g · σ(alpha · g)


def _relu2(t: torch.Tensor) -> torch.Tensor:
    return F.relu(t).square()


_ELEMENTWISE = {"swiglu": F.silu, "geglu": F.gelu, "silu": F.silu, "gelu": F.gelu, "relu": F.relu, "relu2": _relu2}


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def is_gated(activation: str) -> bool:
    check_activation(activation)
    return activation in GATED


def up_width(activation: str, h: int) -> int:
    """Rows of w1 per expert: 2h for gated activations (gate and up rows), h for plain ones.

    Args:
        activation: a name of ACTIVATIONS.
        h: the expert width.

    Returns:
        F, an int.
    """
    return 2 * h if is_gated(activation) else h


def split_gate_up(preact: torch.Tensor, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) columns of a gated pre-activation: halves, or even / odd columns where interleaved."""
    if interleaved:
        return preact[..., ::2], preact[..., 1::2]
    return preact.chunk(2, dim=-1)


def apply_activation(preact: torch.Tensor, activation: str, interleaved: bool = False) -> torch.Tensor:
    """act(H): (.., 2h) -> (.., h) for gated activations, (.., h) -> (.., h) for plain ones.

    Args:
        preact: (..., F) pre-activation, F = 2h for gated activations ([gate | up], or alternating where
            interleaved), h for plain ones.
        activation: a name of ACTIVATIONS.
        interleaved: gate and up rows alternate.

    Returns:
        (..., h) in preact's dtype.
    """
    if not is_gated(activation):
        return _ELEMENTWISE[activation](preact)
    gate, up = split_gate_up(preact, interleaved)
    if activation == "clamped_swiglu":
        gate = gate.clamp(max=CLAMP_LIMIT)
        return (up.clamp(-CLAMP_LIMIT, CLAMP_LIMIT) + 1) * gate * torch.sigmoid(CLAMP_ALPHA * gate)
    return _ELEMENTWISE[activation](gate) * up
