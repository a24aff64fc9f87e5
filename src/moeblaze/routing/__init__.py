"""Routing: the router (top-k scores, balancing losses, expert-bias updates), the O(L·K) routing index and token
rounding. The names here are what a user calls; the builders, checks and kernels live in the submodules (index,
rounding, router, checks, triton)."""
from ..configs import AUX_LOSSES, ROUTERS, RULES, SCORINGS, RouterConfig  # noqa: F401  (the choices, here too)
from .index import METHODS, RoutingIndex, build_routing_index  # noqa: F401
from .rounding import round_to_index
from .router import RouterOutput, TopKRouter, route_topk, update_expert_biases

__all__ = ["ROUTERS", "RouterConfig", "RouterOutput", "RoutingIndex", "TopKRouter", "build_routing_index",
           "round_to_index", "route_topk", "update_expert_biases"]
