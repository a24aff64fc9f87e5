"""The named choices of moeblaze's options outside the experts' recipe (moeblaze.recipe has those), torch-free:
the command line offers and refuses them before torch loads, and the modules that run them check against these.

Memory: none (names).
"""
from __future__ import annotations

# Routers of model families by name (TopKRouter's options; see research notes on routing): "default" is the
# softmax top-k, renormalized, with the switch loss (Mixtral's).
ROUTERS = {
    "default": {},
    "mixtral": dict(scoring="softmax_topk", renormalize=True, aux_loss="switch"),
    "qwen3-moe": dict(scoring="softmax_topk", renormalize=True, aux_loss="global"),
    "qwen3-next": dict(scoring="softmax_topk", renormalize=True, aux_loss="global"),
    "olmoe": dict(scoring="softmax_topk", renormalize=False, aux_loss="switch"),
    "deepseek-v3": dict(scoring="sigmoid_topk", renormalize=True, route_scale=2.5, expert_bias=True, num_groups=8,
                        topk_groups=4, aux_loss="sequence"),
    "gpt-oss": dict(scoring="topk_softmax", gate_bias=True, aux_loss="switch"),
}
RULES = ("nr-f", "up", "down")  # token rounding's rules (moeblaze.routing.rounding)
DISPATCHES = ("exact", "capacity")  # expert parallelism's all-to-all (moeblaze.distributed.ep)
OVERFLOW = ("error", "drop")  # what capacity dispatch does with rows past the capacity
UNITS = ("blocks", "model")  # FSDP2's units (moeblaze.distributed.fsdp)
