"""Pure PyTorch oracles. Nothing here imports kernels."""
# what the kernels' packages check against, beside what a user calls (__all__)
from .activations import (ACTIVATIONS, CLAMP_ALPHA, CLAMP_LIMIT, GATED, PLAIN, apply_activation,  # noqa: F401
                          check_activation, is_gated, split_gate_up, up_width)
from .experts import moe_experts_dense, moe_experts_reference
from .fp8 import (FP8, FP8_MAX, dequantize_blocks, dequantize_rows, fake_quant_blocks, fake_quant_rows,  # noqa: F401
                  quantize_blocks, quantize_rows)

__all__ = ["ACTIVATIONS", "apply_activation", "moe_experts_dense", "moe_experts_reference", "up_width"]
