"""moeblaze: memory-efficient Mixture-of-Experts training layers (PyTorch + Triton).

    from moeblaze import ExpertsConfig, MoELayer, RouterConfig
    layer = MoELayer(1024, 4096, num_experts=16, top_k=2, experts=ExpertsConfig(checkpoint="recompute"),
                     router=RouterConfig.family("qwen3-moe"))
    out, aux_loss, z_loss = layer(x)

The names below load (with torch and Triton) when first used, so that the `moeblaze` command can set the
process's OpenMP options before torch starts its threads.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.2.0"
_HOME = {"moe_experts": "experts", "ExpertsConfig": "configs", "RouterConfig": "configs", "SharedConfig": "configs",
         "RoundingConfig": "configs", "EPConfig": "configs", "ModelConfig": "configs", "MoEBlock": "nn",
         "MoELayer": "nn", "MoEModel": "nn", "MoEOutput": "nn", "moe_experts_reference": "reference",
         "RoutingIndex": "routing", "TopKRouter": "routing", "build_routing_index": "routing"}
__all__ = [*_HOME, "__version__"]

if TYPE_CHECKING:  # the names as type checkers and editors see them
    from .experts import moe_experts  # noqa: F401
    from .configs import EPConfig, ExpertsConfig, ModelConfig, RoundingConfig, RouterConfig, SharedConfig  # noqa: F401
    from .nn import MoEBlock, MoELayer, MoEModel, MoEOutput  # noqa: F401
    from .reference import moe_experts_reference  # noqa: F401
    from .routing import RoutingIndex, TopKRouter, build_routing_index  # noqa: F401


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):  # a subpackage as an attribute (moeblaze.experts), as after an eager import
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__})
