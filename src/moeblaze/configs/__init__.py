"""moeblaze's configuration: one frozen value per concern, each checked once, where it is made, naming the field.
Torch-free: the command line builds and checks them before torch loads.

    ExpertsConfig   how the experts compute (the recipe; configs/experts.py has its fields)
    RouterConfig    how tokens choose experts: scoring, renormalization, scale, biases, groups, balancing loss
                    (moeblaze.routing.router); ROUTERS names the sets of model families
    RoundingConfig  token rounding (moeblaze.routing.rounding): its rule, tile and experts per token
    SharedConfig    always-on shared experts: how many, their width, their gate
    EPConfig        expert parallelism's dispatch (moeblaze.distributed.ep): exact or capacity, overflow
    ModelConfig     the small language model (moeblaze.nn.MoEModel): its shape and the configs above
A rule between a config and the layer's shape (top_k <= num_experts, the router's groups, rounding's experts per
token) is checked by check_layer, once, where a layer or a model config is made. "Unset" is None everywhere.

Memory: none (frozen dataclasses of a few fields).
"""
# the checks and 0.1's keyword forms the layers use, beside what a user calls (the list below)
from .experts import (ACTIVATIONS, BACKENDS, CHECKPOINTS, DEFAULT, GATED, INDEX_METHODS,  # noqa: F401
                      LAUNCH_BACKENDS, LEGACY, PLAIN, PRECISIONS, ExpertsConfig, fold_impl, from_legacy)
from .layer import (AUX_LOSSES, DEFAULT_CAPACITY_FACTOR, DISPATCHES, OVERFLOW, ROUTERS, RULES,  # noqa: F401
                    SCORINGS, UNITS, WIRES, EPConfig, RoundingConfig, RouterConfig, SharedConfig, check_config,
                    check_heads, check_layer, layer_configs)
from .model import ModelConfig, flat_rounding, flat_shared  # noqa: F401

__all__ = ["ACTIVATIONS", "AUX_LOSSES", "BACKENDS", "CHECKPOINTS", "DISPATCHES", "INDEX_METHODS", "OVERFLOW",
           "PRECISIONS", "ROUTERS", "RULES", "SCORINGS", "UNITS", "WIRES", "EPConfig", "ExpertsConfig", "ModelConfig",
           "RoundingConfig", "RouterConfig", "SharedConfig"]
