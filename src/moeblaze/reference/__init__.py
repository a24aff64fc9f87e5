"""Pure PyTorch oracles. Nothing here imports kernels."""
from .activations import (ACTIVATIONS, CLAMP_ALPHA, CLAMP_LIMIT, GATED, PLAIN, apply_activation, check_activation,
                          is_gated, split_gate_up, up_width)
from .experts import moe_experts_dense, moe_experts_reference
from .fp8 import (FP8, FP8_MAX, dequantize_blocks, dequantize_rows, fake_quant_blocks, fake_quant_rows, quantize_blocks,
                  quantize_rows)

__all__ = [
    "ACTIVATIONS", "CLAMP_ALPHA", "CLAMP_LIMIT", "GATED", "PLAIN", "apply_activation", "check_activation", "is_gated",
    "split_gate_up", "up_width",
    "moe_experts_dense", "moe_experts_reference",
    "FP8", "FP8_MAX", "dequantize_blocks", "dequantize_rows", "fake_quant_blocks", "fake_quant_rows", "quantize_blocks",
    "quantize_rows",
]
