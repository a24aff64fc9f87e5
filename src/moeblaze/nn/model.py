"""A small decoder-only MoE language model: token + position embeddings, pre-norm blocks of causal
self-attention (scaled_dot_product_attention) and an MoE feed-forward, RMSNorm, tied output head.

Memory: attention and norms keep what autograd keeps; each MoE FFN keeps what its MoELayer's contract says.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..args import check_bool, check_choice, check_int
from ..recipe import ExpertsConfig, from_legacy
from ..reference import apply_activation, up_width
from ..routing import ROUTERS, RULES
from ..routing.router import check_groups
from .moe import MoELayer, MoEOutput


@dataclass(kw_only=True)
class ModelConfig:
    """The small MoE language model's shape and recipe (MoEModel), checked when made.

    Args:
        vocab_size, max_seq_len: tokens (bytes: 256) and the longest sequence.
        d_model, n_layers, n_heads: the hidden size, the blocks, the attention heads (d_model % n_heads == 0).
        num_experts, top_k, d_expert: each MoE layer's experts, experts per token, expert width.
        experts: the routed experts' moeblaze.ExpertsConfig (a dict loads, as to_dict writes it).
        router: a model family's routing by name (moeblaze.routing.ROUTERS).
        shared_experts, d_shared, shared_gate: always-on experts per layer, their width (0: d_expert), a sigmoid
            gate on their output.
        dense_layers: the first blocks have a dense feed-forward instead of the MoE layer.
        token_rounding, rounding_tile: a rule of moeblaze.routing.rounding ("" for none) and its tile (0: the
            kernels' row tile), while training.

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
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)  # the routed experts' recipe (a dict loads)
    router: str = "default"  # a family's routing: moeblaze.routing.ROUTERS
    shared_experts: int = 0  # always-on experts per MoE layer
    d_shared: int = 0  # their width (0: d_expert)
    shared_gate: bool = False  # σ(x·gᵀ) scales their output (Qwen3-Next)
    dense_layers: int = 0  # the first blocks have a dense feed-forward of width top_k · d_expert (DeepSeek-V3)
    token_rounding: str = ""  # "", or a rule of moeblaze.routing.rounding (training only)
    rounding_tile: int = 0  # its tile (0: the kernels' row tile)

    def __post_init__(self):
        """Every field checked here, so a bad config fails when it is made, naming the field."""
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "num_experts", "top_k",
                     "d_expert"):
            check_int(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k must satisfy 1 <= top_k <= num_experts ({self.num_experts}), got {self.top_k}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if isinstance(self.experts, dict):  # as to_dict writes it (a checkpoint's config)
            self.experts = ExpertsConfig(**self.experts)
        if not isinstance(self.experts, ExpertsConfig):
            raise TypeError(f"experts must be a moeblaze.ExpertsConfig, got {type(self.experts).__name__}")
        if self.token_rounding:
            check_choice("token_rounding", self.token_rounding, RULES)
        for name in ("shared_experts", "d_shared", "dense_layers", "rounding_tile"):
            check_int(name, getattr(self, name), minimum=0)
        check_bool("shared_gate", self.shared_gate)
        if not self.shared_experts and (self.shared_gate or self.d_shared):
            raise ValueError(f"{'shared_gate' if self.shared_gate else 'd_shared'} configures shared experts, but "
                             "shared_experts is 0")
        if self.dense_layers > self.n_layers:
            raise ValueError(f"dense_layers must be <= n_layers ({self.n_layers}), got {self.dense_layers}")
        check_choice("router", self.router, tuple(ROUTERS))
        opts = ROUTERS[self.router]
        if opts.get("num_groups", 1) > 1:
            check_groups(self.num_experts, self.top_k, opts["num_groups"], opts["topk_groups"])

    @property
    def activation(self) -> str:
        return self.experts.activation

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """The config to_dict wrote, also in 0.1's form (the experts' options as flat fields)."""
        d = dict(d)
        flat = {k: d.pop(k) for k in ("activation", "impl", "checkpoint", "precision", "fp8_weight_cache") if k in d}
        if flat:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                d["experts"] = from_legacy("ModelConfig", None, flat)
        return cls(**d)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class DenseFFN(nn.Module):
    """A dense feed-forward layer of the model's activation (the first blocks of DeepSeek-V3-style models); its
    router losses are 0."""

    def __init__(self, d_model: int, d_hidden: int, activation: str):
        super().__init__()
        self.activation = activation
        self.up = nn.Linear(d_model, up_width(activation, d_hidden), bias=False)
        self.down = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> MoEOutput:
        zero = x.new_zeros((), dtype=torch.float32)
        return MoEOutput(self.down(apply_activation(self.up(x), self.activation)), zero, zero)


class MoEBlock(nn.Module):
    """x + attn(norm(x)), then + moe(norm(x)); returns the new x and the block's router losses. `dense`: a
    DenseFFN in place of the MoE layer.

    Args:
        cfg: the model's ModelConfig.
        dense: a dense feed-forward of width top_k · d_expert instead of the MoE layer.

    Returns:
        forward(x (B, T, d_model)) -> (x (B, T, d_model), aux_loss, z_loss), the losses fp32 scalars.
    """

    def __init__(self, cfg: ModelConfig, dense: bool = False):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        if dense:
            self.moe = DenseFFN(cfg.d_model, cfg.top_k * cfg.d_expert, cfg.activation)
        else:
            self.moe = MoELayer(cfg.d_model, cfg.d_expert, cfg.num_experts, cfg.top_k, experts=cfg.experts,
                                router=ROUTERS[cfg.router], shared_experts=cfg.shared_experts,
                                d_shared=cfg.d_shared or None, shared_gate=cfg.shared_gate,
                                token_rounding=cfg.token_rounding or None, rounding_tile=cfg.rounding_tile or None)

    def forward(self, x: torch.Tensor):
        x = x + self.attn(self.norm1(x))
        m = self.moe(self.norm2(x))
        return x + m.out, m.aux_loss, m.z_loss


class MoEModel(nn.Module):
    """A small decoder-only MoE language model (the module header): embeddings, cfg.n_layers MoEBlocks, RMSNorm,
    the output head tied to the token embedding.

    Args:
        cfg: the ModelConfig.

    Returns:
        forward(idx (B, T) int64 token ids, T <= max_seq_len) -> (logits (B, T, vocab_size), aux_loss, z_loss),
        the router losses fp32 scalars summed over the blocks.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(MoEBlock(cfg, dense=i < cfg.dense_layers) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)

    def forward(self, idx_BT: torch.Tensor):
        """(logits (B, T, V), aux_loss, z_loss), the losses summed over blocks."""
        B, T = idx_BT.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.tok_emb(idx_BT) + self.pos_emb(torch.arange(T, device=idx_BT.device))
        aux = z = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, a, zl = block(x)
            aux, z = aux + a, z + zl
        logits = self.norm(x) @ self.tok_emb.weight.t()
        return logits, aux, z
