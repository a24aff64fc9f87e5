"""ModelConfig: the small language model's shape and its layers' configs (moeblaze.nn.MoEModel), checked when made;
to_dict / from_dict for checkpoints (earlier forms load).

Memory: none.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

from ..args import check_int
from .experts import ExpertsConfig, from_legacy
from .layer import RoundingConfig, RouterConfig, SharedConfig, check_heads, check_layer, layer_configs


@dataclass(kw_only=True)
class ModelConfig:
    """The small MoE language model's shape and recipe (moeblaze.nn.MoEModel), checked when made.

    Args:
        vocab_size, max_seq_len: tokens (bytes: 256) and the longest sequence.
        d_model, n_layers, n_heads: the hidden size, the blocks, the attention heads (d_model % n_heads == 0).
        num_experts, top_k, d_expert: each MoE layer's experts, experts per token, expert width.
        experts: the routed experts' ExpertsConfig.
        router: the RouterConfig (a model family's: ROUTERS[name] or RouterConfig.family(name)).
        shared: the shared experts' SharedConfig (None: none).
        rounding: token rounding's RoundingConfig while training (None: plain top-k).
        dense_layers: the first blocks have a dense feed-forward of width top_k · d_expert (DeepSeek-V3).
        (each config also loads from the dict to_dict writes: from_dict)

    Returns:
        The config; ValueError or TypeError naming the field for one it refuses.
    """

    vocab_size: int = 256
    max_seq_len: int = 128
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    d_expert: int = 256
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    shared: SharedConfig | None = None
    rounding: RoundingConfig | None = None
    dense_layers: int = 0

    def __post_init__(self):
        """Every field checked here, so a bad config fails when it is made, naming the field."""
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "num_experts", "top_k",
                     "d_expert"):
            check_int(name, getattr(self, name))
        check_int("dense_layers", self.dense_layers, minimum=0)
        check_heads(self.d_model, self.n_heads)
        if self.dense_layers >= self.n_layers:
            raise ValueError(f"dense_layers must be < n_layers ({self.n_layers}): with {self.dense_layers} every block "
                             "is dense and the model has no MoE layer")
        for name, kind in (("experts", ExpertsConfig), ("router", RouterConfig), ("shared", SharedConfig),
                           ("rounding", RoundingConfig)):
            if isinstance(getattr(self, name), dict):  # as to_dict writes it (a checkpoint's config)
                setattr(self, name, kind(**getattr(self, name)))
        if not isinstance(self.experts, ExpertsConfig):
            raise TypeError(f"experts must be a moeblaze.ExpertsConfig, got {type(self.experts).__name__}")
        self.router, self.shared, self.rounding = layer_configs(self.router, self.shared, self.rounding)
        check_layer(self.num_experts, self.top_k, self.router, self.rounding)

    @property
    def activation(self) -> str:
        return self.experts.activation

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """The config to_dict wrote, also as checkpoints of earlier versions wrote it (the experts' options, the
        shared experts' and token rounding's as flat fields, the router by name)."""
        d = dict(d)
        flat = {k: d.pop(k) for k in ("activation", "impl", "checkpoint", "precision", "fp8_weight_cache") if k in d}
        if flat:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                d["experts"] = from_legacy("ModelConfig", None, flat)
        shared = {k: d.pop(k) for k in ("shared_experts", "d_shared", "shared_gate") if k in d}
        if shared and d.get("shared") is None:
            d["shared"] = flat_shared(shared.get("shared_experts"), shared.get("d_shared"), shared.get("shared_gate"))
        rounding = {k: d.pop(k) for k in ("token_rounding", "rounding_tile") if k in d}
        if rounding and d.get("rounding") is None:
            d["rounding"] = flat_rounding(rounding.get("token_rounding"), rounding.get("rounding_tile"))
        if isinstance(d.get("router"), str):
            d["router"] = RouterConfig.family(d["router"])
        return cls(**d)


def flat_shared(shared_experts: int | None, d_shared: int | None, shared_gate: bool | None) -> SharedConfig | None:
    """The SharedConfig of flat options (an earlier version's checkpoint config, the command line's flags); 0, None or
    False: unset. ValueError for a width or a gate without shared experts, TypeError for a gate that is no bool."""
    if shared_gate is not None and not isinstance(shared_gate, bool):
        raise TypeError(f"shared_gate must be a bool or None, got {shared_gate!r} ({type(shared_gate).__name__})")
    if not shared_experts:
        if d_shared or shared_gate:
            k, v = ("shared_gate", shared_gate) if shared_gate else ("d_shared", d_shared)
            raise ValueError(f"{k}={v!r} configures shared experts, but shared_experts is {shared_experts or 0}")
        return None
    return SharedConfig(shared_experts, d_shared or None, bool(shared_gate))


def flat_rounding(token_rounding: str | None, rounding_tile: int | None,
                  rounding_max_experts: int | None = None) -> RoundingConfig | None:
    """The RoundingConfig of flat options (an earlier version's checkpoint config, the command line's flags); None or
    "": unset. ValueError for a tile or a bound without a rule."""
    if not token_rounding:
        given = [f"{k}={v!r}" for k, v in (("rounding_tile", rounding_tile),
                                           ("rounding_max_experts", rounding_max_experts)) if v]
        if given:
            raise ValueError(f"{', '.join(given)} configures token rounding, but token_rounding is unset")
        return None
    return RoundingConfig(token_rounding, rounding_tile or None, rounding_max_experts)

