"""Expert activations, defined once for every implementation.

Gated activations (SwiGLU, GeGLU) split the up-projection output H (.., 2h) into [gate | up]
(gate columns first) and return act(gate) * up. Plain activations (SiLU, GELU, ReLU, squared ReLU)
apply act to H (.., h). GELU is the exact (erf) form, as torch.nn.functional.gelu's default.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

GATED = ("swiglu", "geglu")
PLAIN = ("silu", "gelu", "relu", "relu2")
ACTIVATIONS = GATED + PLAIN


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
    """Rows of w1 per expert: 2h for gated activations (gate rows first), h for plain ones."""
    return 2 * h if is_gated(activation) else h


def apply_activation(preact: torch.Tensor, activation: str) -> torch.Tensor:
    """act(H): (.., 2h) -> (.., h) for gated activations, (.., h) -> (.., h) for plain ones."""
    fn = _ELEMENTWISE[activation]
    if is_gated(activation):
        gate, up = preact.chunk(2, dim=-1)
        return fn(gate) * up
    return fn(preact)
