"""Routing: the router (top-k scores, balancing losses, expert-bias updates), the O(L·K) routing index and token
rounding. The names here are what a user calls; the builders, checks and kernels live in the submodules (index,
rounding, router, checks, triton)."""
from ..configs import ROUTERS
from .index import METHODS, RoutingIndex, build_routing_index
from .rounding import RULES, round_to_index
from .router import AUX_LOSSES, SCORINGS, RouterOutput, TopKRouter, route_topk, update_expert_biases

__all__ = ["AUX_LOSSES", "METHODS", "ROUTERS", "RULES", "SCORINGS", "RouterOutput", "RoutingIndex", "TopKRouter",
           "build_routing_index", "round_to_index", "route_topk", "update_expert_biases"]
