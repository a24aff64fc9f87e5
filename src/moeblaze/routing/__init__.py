"""Router (top-k scores and losses) and the O(L·K) routing index with its two builders."""
from .checks import check_expert_inputs, check_topk_idx, check_topk_weights
from .index import (DENSE_MAX_EXPERTS, METHODS, RoutingIndex, build_index_dense_torch, build_index_dense_triton,
                    build_index_sort, build_routing_index, count_per_expert, in_row_order, pair_experts)
from .rounding import (RULES, RoundedRouting, default_max_experts, round_to_index, round_tokens, round_tokens_fast,
                       rounded_counts, rounded_index, rounded_rows_bound)
from .router import (AUX_LOSSES, ROUTERS, SCORINGS, RouterOutput, TopKRouter, balance_probs, route_topk, router_z_loss,
                     sequence_aux_loss, switch_aux_loss, update_expert_biases)

__all__ = [
    "check_expert_inputs", "check_topk_idx", "check_topk_weights", "DENSE_MAX_EXPERTS", "METHODS", "RoutingIndex",
    "build_index_dense_torch", "build_index_dense_triton", "build_index_sort", "build_routing_index",
    "count_per_expert", "in_row_order", "pair_experts", "SCORINGS",
    "AUX_LOSSES", "ROUTERS", "RouterOutput", "TopKRouter", "balance_probs", "route_topk", "router_z_loss",
    "sequence_aux_loss", "switch_aux_loss", "update_expert_biases", "RULES", "RoundedRouting", "round_tokens",
    "round_tokens_fast", "round_to_index", "rounded_counts", "rounded_index", "rounded_rows_bound",
    "default_max_experts",
]
