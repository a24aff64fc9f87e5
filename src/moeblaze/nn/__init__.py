"""nn.Modules: the MoE layer, the MoE transformer block and a small MoE language model."""
from .model import CausalSelfAttention, ModelConfig, MoEBlock, MoEModel
from .moe import Experts, MoELayer, MoEOutput, SharedExperts

__all__ = ["CausalSelfAttention", "Experts", "ModelConfig", "MoEBlock", "MoEModel", "MoELayer", "MoEOutput",
           "SharedExperts"]
