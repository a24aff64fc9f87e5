"""nn.Modules: the MoE layer, the MoE transformer block and a small MoE language model."""
from .model import CausalSelfAttention, ModelConfig, MoEBlock, MoEModel
from .moe import MoELayer, MoEOutput

__all__ = ["CausalSelfAttention", "ModelConfig", "MoEBlock", "MoEModel", "MoELayer", "MoEOutput"]
