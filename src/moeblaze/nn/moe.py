"""MoELayer: router + routing index + experts + combine, as one nn.Module; the experts' weights and their
computation are a submodule of their own (Experts), so that FSDP2 shards and gathers them as one unit; optional
shared experts (SharedExperts: always on, never routed) beside them.

Memory contract: the router's (L, E) fp32 logits (as in every MoE), the routing index (O(L·K) int32)
and what the expert implementation keeps (see experts/op.py: the pre-activation under
checkpoint="preact", nothing more under "recompute"); shared experts keep the same for L·S rows (S shared
experts: their (L, S) index, and under "preact" their pre-activation L·S·F_s) and, gated, the (L, 1) gate. No
(L·K, D) routing buffer is ever allocated by the Triton implementation, nor an (L·S, D) one for shared experts.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn

from ..args import check_int
from ..configs import (DEFAULT, ExpertsConfig, RoundingConfig, RouterConfig, SharedConfig, check_layer, from_legacy,
                       layer_configs)
from ..experts import routed_call
from ..experts.schedule import BLOCK_M
from ..reference import up_width
from ..routing import TopKRouter, round_to_index
from ..routing.index import count_per_expert
from ..routing.rounding import default_max_experts, rounded_rows_bound
from ..routing.checks import fail_if

class MoEOutput(NamedTuple):
    """What MoELayer.forward returns.

    Args:
        out: the layer's output, x's shape and dtype.
        aux_loss: the router's load-balancing loss, an fp32 scalar (unscaled).
        z_loss: the router's z-loss, an fp32 scalar (unscaled).
    """
    out: torch.Tensor  # same shape as the input
    aux_loss: torch.Tensor  # switch load-balancing loss (unscaled)
    z_loss: torch.Tensor  # router z-loss (unscaled)


class Experts(nn.Module):
    """The experts: w1 (E, F, D) with F = 2·d_expert (gate rows first) for gated activations and d_expert for
    plain ones, w2 (E, D, d_expert), and their computation on a top-k routing (moeblaze.experts.moe_experts).
    moeblaze.distributed.ExpertParallel takes its place to split the experts over several processes.

    Args:
        d_model, d_expert, num_experts: D, the expert width H, E.
        experts: the experts' moeblaze.ExpertsConfig (config=, its 0.2 name, and 0.1's keyword form work with a
            DeprecationWarning).
        device, dtype: of the parameters.

    Returns:
        forward(x (L, D), topk_idx (L, K) int or None, topk_weights (L, K) float, routing=None) -> (L, D) in x's
        dtype (autocast's where it is on).
    """

    def __init__(self, d_model: int, d_expert: int, num_experts: int, *, experts: ExpertsConfig = DEFAULT, device=None,
                 dtype=None, **legacy):
        super().__init__()
        self.config = from_legacy(type(self).__name__, experts, legacy)
        self.d_model, self.d_expert, self.num_experts = d_model, d_expert, num_experts
        F = up_width(self.config.activation, d_expert)
        self.w1 = nn.Parameter(torch.empty(num_experts, F, d_model, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_model, d_expert, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=1.0 / math.sqrt(self.d_model))
        nn.init.normal_(self.w2, std=1.0 / math.sqrt(self.d_expert))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1, w2) as this process computes with them."""
        return self.w1, self.w2

    def forward(self, x_LD: torch.Tensor, topk_idx: torch.Tensor | None, topk_weights: torch.Tensor,
                routing=None) -> torch.Tensor:
        """routing: a prebuilt RoutingIndex (token rounding's, with topk_weights in its table's layout) instead of
        one built from topk_idx."""
        return routed_call(x_LD, topk_idx, topk_weights, *self.weights(), experts=self.config, routing=routing)

    def extra_repr(self) -> str:
        return describe_experts(self)


def describe_experts(m) -> str:
    """An experts module's sizes and the options its config changes from the default (its extra_repr)."""
    changed = ", ".join(f"{k}={getattr(m.config, k)!r}" for k in m.config.__dataclass_fields__
                        if getattr(m.config, k) != getattr(DEFAULT, k))
    sizes = f"d_model={m.d_model}, d_expert={m.d_expert}, num_experts={m.num_experts}"
    return sizes + (f", {changed}" if changed else "")


class SharedExperts(Experts):
    """S always-on experts of their own width: every token goes to each of them with weight 1, or with a learned
    gate σ(x·gᵀ) (Qwen3-Next's shared_expert_gate), and their outputs are summed. The routed experts' kernels
    compute them through an index that sends every token to each shared expert in token order (rows read in
    place: no gathered copy), in a launch of their own, since their weights are tensors of their own. Never a
    routing target: outside the router's losses, its bias updates and expert parallelism (each rank keeps all S,
    like the dense weights).

    Args:
        d_model, d_hidden, count: D, their width, S.
        experts: the routed experts' moeblaze.ExpertsConfig (run here in native precision with the dense index).
        gated: a learned gate g (1, D) scales their output by σ(x·gᵀ).
        device, dtype: of the parameters.

    Returns:
        forward(x (L, D)) -> (L, D) in x's dtype: the sum of the S experts' outputs, gated where `gated`.
    """


    def __init__(self, d_model: int, d_hidden: int, count: int, *, experts: ExpertsConfig = DEFAULT,
                 gated: bool = False, device=None, dtype=None):
        check_int("shared_experts", count)
        check_int("d_shared", d_hidden)
        # native precision and the dense index: the routed experts' fp8 recipe is theirs alone
        experts = experts.native().replace(index_method="dense")
        super().__init__(d_model, d_hidden, count, experts=experts, device=device, dtype=dtype)
        self.gate = nn.Parameter(torch.zeros(1, d_model, device=device, dtype=dtype)) if gated else None

    def forward(self, x_LD: torch.Tensor) -> torch.Tensor:
        L, S = x_LD.shape[0], self.num_experts
        idx = torch.arange(S, dtype=torch.int32, device=x_LD.device).expand(L, S)
        if self.gate is None:
            w = torch.ones(L, S, dtype=torch.promote_types(x_LD.dtype, torch.float32), device=x_LD.device)
        else:
            dt = torch.promote_types(x_LD.dtype, torch.float32)  # fp32 at least, as router scores
            w = torch.sigmoid(x_LD.to(dt) @ self.gate.to(dt).t()).expand(L, S)
        return super().forward(x_LD, idx, w)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", gated" if self.gate is not None else "")


class MoELayer(nn.Module):
    """Token-choice top-k MoE feed-forward layer, dropless: a router (`router`), the routed experts (`experts`) and
    optional shared experts (`shared`), each configured by one moeblaze config.

    Weights: experts.w1 (E, F, D) with F = 2·d_expert (gate rows first) for gated activations and d_expert for
    plain ones; experts.w2 (E, D, d_expert) (also reachable as layer.w1, layer.w2; state dicts saved with
    the earlier top-level keys "w1", "w2" load). x of shape (..., T, D) holds sequences of T tokens (the
    "sequence" loss). Token rounding (moeblaze.routing.rounding) applies while training; evaluation routes plain
    top-k. track_load (attribute, default False): while training, add each expert's computed pairs (after
    rounding, this rank's tokens) to the int64 buffer `routed_load` (E,), on the device (no host sync); the caller
    reads and zeroes it (moeblaze train --loss-log logs max/mean load per layer and step).

    Args:
        d_model, d_expert, num_experts, top_k: D, the expert width H, E, K.
        experts: the routed experts' moeblaze.ExpertsConfig (shared experts follow it in native precision).
        router: the moeblaze.RouterConfig (None: the default; a family's: RouterConfig.family(name)).
        shared: a moeblaze.SharedConfig for always-on shared experts (None: none).
        rounding: a moeblaze.RoundingConfig for token rounding while training (None: plain top-k); its tile and
            max_experts left None become the kernels' row tile and min(E, 4K) (layer.rounding has them).
        device, dtype: of the parameters.
        (0.1's form, the experts' options as keyword arguments, works with a DeprecationWarning that names the
        new form.)

    Returns:
        forward(x (..., D)) -> MoEOutput: out of x's shape and dtype, aux_loss and z_loss fp32 scalars.
    """

    def __init__(self, d_model: int, d_expert: int, num_experts: int, top_k: int, *,
                 experts: ExpertsConfig = DEFAULT, router: RouterConfig | None = None,
                 shared: SharedConfig | None = None, rounding: RoundingConfig | None = None, device=None, dtype=None,
                 **legacy):
        super().__init__()
        check_int("d_model", d_model)
        check_int("d_expert", d_expert)
        experts = from_legacy("MoELayer", experts, legacy)
        router, shared, rounding = layer_configs(router, shared, rounding)
        check_layer(num_experts, top_k, router, rounding)
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.router = TopKRouter(d_model, num_experts, top_k, config=router, device=device)
        self.experts = Experts(d_model, d_expert, num_experts, experts=experts, device=device, dtype=dtype)
        if rounding is not None:
            rounding = rounding.replace(tile=rounding.tile or BLOCK_M,
                                        max_experts=rounding.max_experts or default_max_experts(num_experts, top_k))
        self.rounding = rounding
        self.shared = None
        if shared is not None:
            self.shared = SharedExperts(d_model, shared.d_hidden or d_expert, shared.count, experts=experts,
                                        gated=shared.gated, device=device, dtype=dtype)
        self.track_load = False
        self.register_buffer("routed_load", torch.zeros(num_experts, dtype=torch.int64, device=device),
                             persistent=False)
        self._register_load_state_dict_pre_hook(_earlier_expert_keys)

    @property
    def w1(self) -> nn.Parameter:
        return self.experts.w1

    @property
    def w2(self) -> nn.Parameter:
        return self.experts.w2

    def forward(self, x: torch.Tensor) -> MoEOutput:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a float tensor, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"expected last dimension {self.d_model}, got input of shape {tuple(x.shape)}")
        x_LD = x.reshape(-1, self.d_model)
        r = self.router(x_LD, seq_len=x.shape[-2] if x.dim() >= 3 else None)
        if self.rounding is not None and self.training:
            w, index = self._rounded(r)
            out = self.experts(x_LD, None, w, index)
            counts = index.expert_counts
        else:
            out = self.experts(x_LD, r.topk_idx, r.topk_weights)
            counts = None
        if self.track_load and self.training:
            self.routed_load += count_per_expert(r.topk_idx, self.num_experts) if counts is None else counts
        if self.shared is not None:
            out = out + self.shared(x_LD)
        return MoEOutput(out.view(x.shape), r.aux_loss, r.z_loss)

    def _rounded(self, r):
        """(weights in the rounded index's table, the index) of token rounding (moeblaze.routing.rounding)."""
        L, K, E, cfg = r.topk_idx.shape[0], self.top_k, self.num_experts, self.rounding
        rt = self.router.config
        rows = rounded_rows_bound(L, K, E, cfg.tile, cfg.rule)
        index, w, overflow = round_to_index(r.logits, r.topk_idx, r.topk_weights, cfg.tile, cfg.rule, rt.scoring,
                                            rt.renormalize, rt.route_scale, max_experts=cfg.max_experts,
                                            max_rows=rows, check=False)  # the router's own ids and weights
        # the rounding keeps both bounds by construction: an overflow here is a bug, never a silent drop
        fail_if(overflow, f"token rounding: the rounded pairs overflow the index's bounds (max_experts="
                f"{cfg.max_experts}, rows {rows})", RuntimeError)  # a device-side assert: no host sync
        return w, index

    def extra_repr(self) -> str:
        rounding = f", rounding={self.rounding}" if self.rounding is not None else ""
        return f"top_k={self.top_k}{rounding}"


def _earlier_expert_keys(state_dict, prefix, *_args) -> None:
    """State dicts from before the experts submodule kept w1 and w2 on the layer: rename them."""
    for name in ("w1", "w2"):
        if prefix + name in state_dict:
            state_dict[prefix + "experts." + name] = state_dict.pop(prefix + name)
