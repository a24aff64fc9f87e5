"""Pure PyTorch oracles. Nothing here imports kernels."""
from .activations import (ACTIVATIONS, CLAMP_ALPHA, CLAMP_LIMIT, GATED, PLAIN, apply_activation, check_activation,
                          is_gated, split_gate_up, up_width)
from .experts import moe_experts_dense, moe_experts_reference

__all__ = [
    "ACTIVATIONS", "CLAMP_ALPHA", "CLAMP_LIMIT", "GATED", "PLAIN", "apply_activation", "check_activation", "is_gated",
    "split_gate_up", "up_width",
    "moe_experts_dense", "moe_experts_reference",
]
