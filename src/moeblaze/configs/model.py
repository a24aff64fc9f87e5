"""ModelConfig: the small language model's shape and its layers' configs (moeblaze.nn.MoEModel), checked when made;
to_dict / from_dict for checkpoints (earlier forms load).

Memory: none.
"""
from __future__ import annotations

import warnings
from dataclasses import InitVar, asdict, dataclass, field

from ..args import check_int
from .experts import ExpertsConfig, from_legacy
from .layer import RoundingConfig, RouterConfig, SharedConfig, check_heads, check_layer
from .legacy import layer_from_legacy


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
        shared_experts, d_shared, shared_gate, token_rounding, rounding_tile: 0.2's flat fields for shared and
            rounding, with a DeprecationWarning (each config also loads from the dict to_dict writes).

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
    shared_experts: InitVar[int | None] = None  # 0.2's flat fields: deprecated
    d_shared: InitVar[int | None] = None
    shared_gate: InitVar[bool | None] = None
    token_rounding: InitVar[str | None] = None
    rounding_tile: InitVar[int | None] = None

    def __post_init__(self, shared_experts, d_shared, shared_gate, token_rounding, rounding_tile):
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
        legacy = dict(shared_experts=shared_experts, d_shared=d_shared, shared_gate=shared_gate,
                      token_rounding=token_rounding, rounding_tile=rounding_tile)
        self.router, self.shared, self.rounding = layer_from_legacy("ModelConfig", self.router, self.shared,
                                                                    self.rounding, legacy, stacklevel=4)
        if not isinstance(self.experts, ExpertsConfig):
            raise TypeError(f"experts must be a moeblaze.ExpertsConfig, got {type(self.experts).__name__}")
        check_layer(self.num_experts, self.top_k, self.router, self.rounding)

    @property
    def activation(self) -> str:
        return self.experts.activation

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """The config to_dict wrote, also in earlier forms (0.1's experts options and 0.2's layer options as flat
        fields, the router by name)."""
        d = dict(d)
        flat = {k: d.pop(k) for k in ("activation", "impl", "checkpoint", "precision", "fp8_weight_cache") if k in d}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            if flat:
                d["experts"] = from_legacy("ModelConfig", None, flat)
            return cls(**d)
