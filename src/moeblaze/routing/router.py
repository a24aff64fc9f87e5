"""Top-k token-choice router: a bias-free linear d -> E, scores in fp32, and its auxiliary losses.

Two conventions:
  "softmax_topk": softmax over all E experts, keep the top K probabilities, optionally renormalize
                  them to sum to 1 (Mixtral, Qwen3, DeepSeek-V2 style);
  "topk_softmax": top K of the logits, then a softmax over those K (SonicMoE, Switch-style).
Losses: the switch load-balancing loss  E * sum_e f_e * P_e  (f_e: fraction of the L·K assignments
that go to expert e, P_e: mean softmax probability of e; 1.0 when perfectly balanced) and the router
z-loss  mean_t logsumexp(logits_t)^2. Both are 0 (finite, with zero gradients) for an empty batch.
Memory: the (L, E) fp32 logits and probabilities live only until backward of the router, as in any router.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..args import check_bool, check_choice, check_int
from .index import count_per_expert

SCORINGS = ("softmax_topk", "topk_softmax")


@dataclass
class RouterOutput:
    topk_idx: torch.Tensor  # (L, K) int32 expert ids
    topk_weights: torch.Tensor  # (L, K) fp32, differentiable
    aux_loss: torch.Tensor  # scalar fp32, switch load-balancing loss
    z_loss: torch.Tensor  # scalar fp32


def route_topk(logits_LE: torch.Tensor, top_k: int, scoring: str = "softmax_topk", renormalize: bool = True):
    """(topk_idx int32 (L, K), topk_weights fp32 (L, K)) from fp32 logits."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    E = logits_LE.shape[-1]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must satisfy 1 <= top_k <= num_experts ({E}), got {top_k}")
    logits_LE = logits_LE.float()
    if scoring == "softmax_topk":
        probs = logits_LE.softmax(dim=-1)
        w, idx = probs.topk(top_k, dim=-1)
        if renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
    else:
        vals, idx = logits_LE.topk(top_k, dim=-1)
        w = vals.softmax(dim=-1)
    return idx.to(torch.int32), w


def switch_aux_loss(logits_LE: torch.Tensor, topk_idx_LK: torch.Tensor) -> torch.Tensor:
    """E * sum_e f_e * P_e; gradients flow through P (the probabilities), as in Switch Transformer."""
    L, E = logits_LE.shape
    probs_mean_E = logits_LE.float().softmax(dim=-1).sum(dim=0) / max(L, 1)  # a mean that is 0, not NaN, at L = 0
    frac_E = count_per_expert(topk_idx_LK, E).float() / max(topk_idx_LK.numel(), 1)
    return E * (frac_E * probs_mean_E).sum()


def router_z_loss(logits_LE: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits_LE.float(), dim=-1).square().sum() / max(logits_LE.shape[0], 1)


class TopKRouter(nn.Module):
    """x (L, D) -> RouterOutput. The gate weight is (E, D), bias-free; scores are computed in fp32."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, scoring: str = "softmax_topk",
                 renormalize: bool = True, device=None, dtype=None):
        super().__init__()
        check_int("d_model", d_model)
        check_int("num_experts", num_experts)
        check_int("top_k", top_k)
        check_choice("scoring", scoring, SCORINGS)
        check_bool("renormalize", renormalize)
        if top_k > num_experts:
            raise ValueError(f"top_k must satisfy 1 <= top_k <= num_experts ({num_experts}), got {top_k}")
        self.num_experts, self.top_k, self.scoring, self.renormalize = num_experts, top_k, scoring, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, d_model, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=d_model ** -0.5)

    def forward(self, x_LD: torch.Tensor) -> RouterOutput:
        logits_LE = x_LD.float() @ self.weight.float().t()
        idx, w = route_topk(logits_LE, self.top_k, self.scoring, self.renormalize)
        return RouterOutput(idx, w, switch_aux_loss(logits_LE, idx), router_z_loss(logits_LE))

    def extra_repr(self) -> str:
        return (f"d_model={self.weight.shape[1]}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"scoring={self.scoring}")
