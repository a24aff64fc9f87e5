"""A small decoder-only MoE language model: token + position embeddings, pre-norm blocks of causal
self-attention (scaled_dot_product_attention) and an MoE feed-forward, RMSNorm, tied output head.

Memory: attention and norms keep what autograd keeps; each MoE FFN keeps what its MoELayer's contract says.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..configs import ModelConfig, check_heads
from ..reference import apply_activation, up_width
from .moe import MoELayer, MoEOutput


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention (scaled_dot_product_attention) with one qkv and one output projection.

    Args:
        d_model, n_heads: the width D and the heads (n_heads divides d_model).

    Returns:
        forward(x (B, T, D)) -> (B, T, D).
    """

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        check_heads(d_model, n_heads)
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
                                router=cfg.router, shared=cfg.shared, rounding=cfg.rounding)

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
