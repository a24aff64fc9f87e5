"""The layer's configs beside the experts' recipe: the router, token rounding, shared experts, expert parallelism,
and the rules between them and a layer's shape (check_layer), each checked once, where it is made.

Memory: none (frozen dataclasses of a few fields).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..args import check_bool, check_choice, check_int, check_positive

SCORINGS = ("softmax_topk", "topk_softmax", "sigmoid_topk")  # RouterConfig.scoring
AUX_LOSSES = ("switch", "sequence", "global", "none")  # RouterConfig.aux_loss
RULES = ("nr-f", "up", "down")  # RoundingConfig.rule
DISPATCHES = ("exact", "capacity")  # EPConfig.dispatch
WIRES = ("native", "e4m3")  # EPConfig.wire: the dtype the tokens' rows and their gradients cross in
OVERFLOW = ("error", "drop")  # EPConfig.on_overflow: what capacity dispatch does with rows past the capacity
UNITS = ("blocks", "model")  # FSDP2's units (moeblaze.distributed.fsdp)
DEFAULT_CAPACITY_FACTOR = 1.25  # EPConfig.capacity_factor when unset


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """How tokens choose experts and what the router's balancing loss is (moeblaze.routing.router has the
    formulas). Frozen: derive another with `.replace(**changes)`; a model family's set is ROUTERS[name].

    Args:
        scoring: "softmax_topk" (default), "sigmoid_topk" or "topk_softmax".
        renormalize: a token's k weights divided by their sum (not for "topk_softmax", which sums to 1).
        route_scale: a positive factor on the weights (DeepSeek-V3's routed_scaling_factor).
        gate_bias: a learned bias on the logits (gpt-oss).
        expert_bias, expert_bias_rate: DeepSeek-V3's balancing bias (it steers the choice only) and its step.
        num_groups, topk_groups: the experts in num_groups equal groups, each token choosing among topk_groups.
        aux_loss: the balancing loss: "switch" (default), "sequence", "global" or "none".

    Returns:
        A frozen value; ValueError or TypeError naming the field for a choice it refuses.
    """
    scoring: str = "softmax_topk"
    renormalize: bool = True
    route_scale: float = 1.0
    gate_bias: bool = False
    expert_bias: bool = False
    expert_bias_rate: float = 1e-3
    num_groups: int = 1
    topk_groups: int = 1
    aux_loss: str = "switch"

    def __post_init__(self):
        check_choice("scoring", self.scoring, SCORINGS)
        for name in ("renormalize", "gate_bias", "expert_bias"):
            check_bool(name, getattr(self, name))
        object.__setattr__(self, "route_scale", check_positive("route_scale", self.route_scale))
        object.__setattr__(self, "expert_bias_rate", check_positive("expert_bias_rate", self.expert_bias_rate))
        if self.expert_bias_rate != 1e-3 and not self.expert_bias:
            raise ValueError(f"expert_bias_rate={self.expert_bias_rate} is the step of expert_bias, which is off: set "
                             "expert_bias=True, or leave the rate")
        check_int("num_groups", self.num_groups)
        check_int("topk_groups", self.topk_groups)
        if self.topk_groups > self.num_groups:
            raise ValueError(f"topk_groups must be <= num_groups ({self.num_groups}), got {self.topk_groups}")
        check_choice("aux_loss", self.aux_loss, AUX_LOSSES)

    def replace(self, **changes) -> RouterConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def family(cls, name: str) -> RouterConfig:
        """The routing of a model family by name (ROUTERS)."""
        check_choice("router", name, tuple(ROUTERS))
        return ROUTERS[name]


# Routers of model families by name (see research notes on routing): "default" is the softmax top-k,
# renormalized, with the switch loss (Mixtral's).
ROUTERS = {
    "default": RouterConfig(),
    "mixtral": RouterConfig(scoring="softmax_topk", renormalize=True, aux_loss="switch"),
    "qwen3-moe": RouterConfig(scoring="softmax_topk", renormalize=True, aux_loss="global"),
    "qwen3-next": RouterConfig(scoring="softmax_topk", renormalize=True, aux_loss="global"),
    "olmoe": RouterConfig(scoring="softmax_topk", renormalize=False, aux_loss="switch"),
    "deepseek-v3": RouterConfig(scoring="sigmoid_topk", renormalize=True, route_scale=2.5, expert_bias=True,
                                num_groups=8, topk_groups=4, aux_loss="sequence"),
    "gpt-oss": RouterConfig(scoring="topk_softmax", gate_bias=True, aux_loss="switch"),
}


@dataclass(frozen=True)
class RoundingConfig:
    """Token rounding while training (moeblaze.routing.rounding): every expert's tokens moved to a multiple of a
    tile. Evaluation routes plain top-k.

    Args:
        rule: "nr-f" (the nearest multiple, default), "up" or "down".
        tile: the multiple (None: the kernels' row tile).
        max_experts: at most this many experts per token, at least the layer's top_k (None: min(E, 4K)).

    Returns:
        A frozen value; ValueError or TypeError naming the field for a choice it refuses.
    """
    rule: str = "nr-f"
    tile: int | None = None
    max_experts: int | None = None

    def __post_init__(self):
        check_choice("rule", self.rule, RULES)
        for name in ("tile", "max_experts"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))

    def replace(self, **changes) -> RoundingConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SharedConfig:
    """Always-on shared experts beside the routed ones (never routed: every token goes to each).

    Args:
        count: how many (S, default 1).
        d_hidden: their width (None: the routed experts' d_expert).
        gated: their summed output scaled by a learned σ(x·gᵀ) (Qwen3-Next's shared_expert_gate).

    Returns:
        A frozen value; ValueError or TypeError naming the field for a choice it refuses.
    """
    count: int = 1
    d_hidden: int | None = None
    gated: bool = False

    def __post_init__(self):
        check_int("count", self.count)
        if self.d_hidden is not None:
            check_int("d_hidden", self.d_hidden)
        check_bool("gated", self.gated)

    def replace(self, **changes) -> SharedConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class EPConfig:
    """Expert parallelism's all-to-all (moeblaze.distributed.ep_experts has the data flow).

    Args:
        dispatch: "exact" (every routed row, default) or "capacity" (a fixed number of rows per pair of ranks).
        capacity_factor: under "capacity", the rows per pair as a multiple of the mean, rounded up to 16 (None: 1.25).
        capacity: under "capacity", the rows per pair outright (None: from capacity_factor; not both).
        on_overflow: under "capacity", a destination needing more rows: "error" (None: the default) or "drop".
        chunks: the all-to-alls in this many parts, each part's running under another part's GEMMs (forward and
            backward; 1: no overlap). Transport "tokens": each destination's rows in that many parts (exact or
            capacity dispatch; eager only); "pairs": under "exact", the local experts in that many groups (bitwise
            the same results).
        transport: how rows cross (moeblaze.distributed.transports): "tokens" (one row per (token, rank), the
            experts there gathering it: a quarter of the pairs' bytes at top-8 over 128 experts on 2 ranks, equal to
            one GPU within the op's rounding; default) or "pairs" (one row per (token, expert) pair, bitwise equal to
            one GPU).
        wire: "native" (rows cross in x's dtype, default) or "e4m3" (transport "tokens": each row of x forward and
            of dy backward crosses as e4m3 with its 1 x 128 float32 scales, about half a bf16 row's bytes, and is
            dequantized where it arrives; the partial sums return in x's dtype). The experts then see those rows
            as dequant(q(x)) and dequant(q(dy)): under precision="fp8" the e4m3 GEMMs read what one GPU reads (the
            same quantization), while dW1 and dW2, which one GPU computes from x and dy in their own precision,
            take the quantized rows; under "native" every product does.

    Returns:
        A frozen value; ValueError or TypeError naming the field for a choice it refuses, or for a capacity option
        that the dispatch would not read.
    """
    dispatch: str = "exact"
    capacity_factor: float | None = None
    capacity: int | None = None
    on_overflow: str | None = None
    chunks: int = 1
    transport: str = "tokens"
    wire: str = "native"

    def __post_init__(self):
        check_choice("dispatch", self.dispatch, DISPATCHES)
        check_choice("wire", self.wire, WIRES)
        check_int("chunks", self.chunks)
        if not isinstance(self.transport, str) or not self.transport:
            raise TypeError(f"transport must be a transport's name (a str), got {self.transport!r}")
        if self.capacity_factor is not None:
            object.__setattr__(self, "capacity_factor", check_positive("capacity_factor", self.capacity_factor))
        if self.capacity is not None:
            check_int("capacity", self.capacity)
        if self.on_overflow is not None:
            check_choice("on_overflow", self.on_overflow, OVERFLOW)
        given = [f"{k}={getattr(self, k)!r}" for k in ("capacity_factor", "capacity", "on_overflow")
                 if getattr(self, k) is not None]
        if given and self.dispatch != "capacity":
            raise ValueError(f"{', '.join(given)} applies to dispatch='capacity' only; dispatch is {self.dispatch!r}")
        if self.capacity is not None and self.capacity_factor is not None:
            raise ValueError("give capacity or capacity_factor, not both")

    def replace(self, **changes) -> EPConfig:
        return dataclasses.replace(self, **changes)

    @property
    def factor(self) -> float:
        return DEFAULT_CAPACITY_FACTOR if self.capacity_factor is None else self.capacity_factor

    @property
    def overflow(self) -> str:
        return self.on_overflow or "error"


def check_layer(num_experts: int, top_k: int, router: RouterConfig | None = None,
                rounding: RoundingConfig | None = None) -> None:
    """The rules between a layer's shape and its configs, each checked here alone: 1 <= top_k <= num_experts, the
    router's groups divide the experts and hold top_k, rounding's max_experts >= top_k. ValueError naming the rule."""
    check_int("num_experts", num_experts)
    check_int("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k must satisfy 1 <= top_k <= num_experts ({num_experts}), got {top_k}")
    if router is not None:
        G, g = router.num_groups, router.topk_groups
        if num_experts % G:
            raise ValueError(f"num_groups ({G}) must divide num_experts ({num_experts})")
        if top_k > g * (num_experts // G):
            raise ValueError(f"top_k ({top_k}) must be <= topk_groups x experts per group ({g} x {num_experts // G})")
    if rounding is not None and rounding.max_experts is not None and rounding.max_experts < top_k:
        raise ValueError(f"rounding's max_experts must be >= top_k ({top_k}), got {rounding.max_experts}")
    if rounding is not None and rounding.max_experts is not None and rounding.max_experts > num_experts:
        raise ValueError(f"rounding's max_experts must be <= num_experts ({num_experts}): above it bounds nothing, "
                         f"got {rounding.max_experts}")


def check_heads(d_model: int, n_heads: int) -> None:
    """ValueError unless n_heads attention heads split d_model evenly."""
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")


def check_config(name: str, value, kind: type):
    """value, a `kind` config or None (TypeError otherwise: a name, a dict or keyword arguments are not configs)."""
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name} must be a moeblaze.{kind.__name__} or None, got {type(value).__name__}")
    return value


def layer_configs(router, shared, rounding) -> tuple:
    """(router, shared, rounding) of a layer or a model config, each type-checked; an unset router is the default."""
    return (check_config("router", router, RouterConfig) or RouterConfig(),
            check_config("shared", shared, SharedConfig), check_config("rounding", rounding, RoundingConfig))
