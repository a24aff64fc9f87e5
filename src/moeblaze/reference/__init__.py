"""Pure PyTorch oracles. Nothing here imports kernels."""
from .activations import ACTIVATIONS, GATED, PLAIN, apply_activation, check_activation, is_gated, up_width
from .experts import moe_experts_dense, moe_experts_reference

__all__ = [
    "ACTIVATIONS", "GATED", "PLAIN", "apply_activation", "check_activation", "is_gated", "up_width",
    "moe_experts_dense", "moe_experts_reference",
]
