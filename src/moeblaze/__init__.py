"""moeblaze: memory-efficient Mixture-of-Experts training layers (PyTorch + Triton).

    from moeblaze import MoELayer
    layer = MoELayer(1024, 4096, num_experts=16, top_k=2, experts=ExpertsConfig(checkpoint="recompute"))
    out, aux_loss, z_loss = layer(x)
"""
from .experts import moe_experts
from .recipe import ExpertsConfig
from .nn import ModelConfig, MoEBlock, MoELayer, MoEModel, MoEOutput
from .reference import moe_experts_reference
from .routing import RoutingIndex, TopKRouter, build_routing_index

__version__ = "0.2.0"
__all__ = ["ExpertsConfig", "ModelConfig", "MoEBlock",
           "MoELayer", "MoEModel", "MoEOutput", "moe_experts", "moe_experts_reference",
           "RoutingIndex", "TopKRouter", "build_routing_index", "__version__"]
