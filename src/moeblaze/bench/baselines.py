"""The conventional MoE pipeline, as the baseline the benchmark and profiler compare with:

    argsort the L·K expert ids -> gather x into an (L·K, D) buffer -> torch._grouped_mm (up)
    -> unfused activation -> torch._grouped_mm (down) -> multiply by the router weights
    -> scatter-add (index_add) into the output

Autograd keeps the gathered buffer, both GEMM outputs, the activation's intermediates and the
weighted rows: the memory wall MoEBlaze removes. Needs row strides that are multiples of 16 bytes.
"""
from __future__ import annotations

import torch

from ..reference import apply_activation
from ..routing.index import count_per_expert


def torch_gmm_experts(x_LD: torch.Tensor, topk_idx_LK: torch.Tensor, topk_w_LK: torch.Tensor, w1_EFD: torch.Tensor,
                      w2_EDH: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    L, K = topk_idx_LK.shape
    E = w1_EFD.shape[0]
    flat = topk_idx_LK.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offs = count_per_expert(flat, E).cumsum(0, dtype=torch.int32)
    tok = order // K
    x_sorted = x_LD[tok]
    h = torch._grouped_mm(x_sorted, w1_EFD.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(apply_activation(h, activation), w2_EDH.transpose(1, 2), offs=offs)
    y = y * topk_w_LK.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x_LD).index_add_(0, tok, y)
