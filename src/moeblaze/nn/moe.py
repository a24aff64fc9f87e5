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

from ..args import check_bool, check_choice, check_int
from ..experts import autocast_operands, moe_experts
from ..experts.schedule import BLOCK_M
from ..recipe import DEFAULT, ExpertsConfig, from_legacy
from ..reference import up_width
from ..routing import ROUTERS, RULES, TopKRouter, build_routing_index, round_to_index
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
    moeblaze.distributed.ExpertParallel takes its place to split the experts over several processes."""

    def __init__(self, d_model: int, d_expert: int, num_experts: int, *, config: ExpertsConfig = DEFAULT, device=None,
                 dtype=None, **legacy):
        super().__init__()
        self.config = from_legacy(type(self).__name__, config, legacy)
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

    def operands(self, x_LD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, w1, w2) as the kernels take them: in the autocast dtype where autocast is on, like nn.Linear."""
        return autocast_operands(x_LD, *self.weights())

    def forward(self, x_LD: torch.Tensor, topk_idx: torch.Tensor | None, topk_weights: torch.Tensor,
                routing=None) -> torch.Tensor:
        """routing: a prebuilt RoutingIndex (token rounding's, with topk_weights in its table's layout) instead of
        one built from topk_idx."""
        x_LD, w1, w2 = self.operands(x_LD)
        if routing is None:
            routing = build_routing_index(topk_idx, self.num_experts, self.config.index_method, check=False)
        return moe_experts(x_LD, routing, topk_weights, w1, w2, config=self.config, check=False)

    def extra_repr(self) -> str:
        changed = ", ".join(f"{k}={getattr(self.config, k)!r}" for k in self.config.__dataclass_fields__
                            if getattr(self.config, k) != getattr(DEFAULT, k))
        return (f"d_model={self.d_model}, d_expert={self.d_expert}, num_experts={self.num_experts}"
                + (f", {changed}" if changed else ""))


class SharedExperts(Experts):
    """S always-on experts of their own width: every token goes to each of them with weight 1, or with a learned
    gate σ(x·gᵀ) (Qwen3-Next's shared_expert_gate), and their outputs are summed. The routed experts' kernels
    compute them through an index that sends every token to each shared expert in token order (rows read in
    place: no gathered copy), in a launch of their own, since their weights are tensors of their own. Never a
    routing target: outside the router's losses, its bias updates and expert parallelism (each rank keeps all S,
    like the dense weights)."""


    def __init__(self, d_model: int, d_hidden: int, count: int, *, config: ExpertsConfig = DEFAULT,
                 gated: bool = False, device=None, dtype=None):
        check_int("shared_experts", count)
        check_int("d_shared", d_hidden)
        # native precision and the dense index: the routed experts' fp8 recipe is theirs alone
        config = config.replace(index_method="dense", precision="native", fp8_weight_cache=False)
        super().__init__(d_model, d_hidden, count, config=config, device=device, dtype=dtype)
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
    """Token-choice top-k MoE feed-forward layer, dropless: a router (`router`) and the experts (`experts`).

    Weights: experts.w1 (E, F, D) with F = 2·d_expert (gate rows first) for gated activations and d_expert for
    plain ones; experts.w2 (E, D, d_expert) (also reachable as layer.w1, layer.w2; state dicts saved with
    the earlier top-level keys "w1", "w2" load). experts: the routed experts' recipe (moeblaze.ExpertsConfig:
    activation, checkpoint policy, backend, precision, chunking, index method); shared experts follow it in
    native precision.
    router: more TopKRouter options (score function, scale, biases, groups, balancing loss; a family's set is
    moeblaze.routing.ROUTERS[name]); x of shape (..., T, D) holds sequences of T tokens (the "sequence" loss).
    shared_experts: S always-on experts of width d_shared (default d_expert), gated by σ(x·gᵀ) with shared_gate
    (the submodule `shared`, a SharedExperts).
    token_rounding: "nr-f", "up" or "down" (moeblaze.routing.rounding): while training, every expert's tokens are
    rounded to a multiple of rounding_tile (default: the kernels' row tile); a token then has at most
    rounding_max_experts experts (default min(E, 4K), at least K): an expert whose rounding up would give a token
    more rounds down instead (moeblaze.routing.rounding). Evaluation routes plain top-k.
    track_load (attribute, default False): while training, add each expert's computed pairs (after rounding, this
    rank's tokens) to the int64 buffer `routed_load` (E,), on the device (no host sync); the caller reads and zeroes
    it (moeblaze train --loss-log logs max/mean load per layer and step).

    Args:
        d_model, d_expert, num_experts, top_k: D, the expert width H, E, K.
        experts: the routed experts' moeblaze.ExpertsConfig.
        scoring, renormalize: override the router's score function and renormalization.
        router: a family's name (moeblaze.routing.ROUTERS) or a dict of TopKRouter options.
        shared_experts, d_shared, shared_gate: S always-on experts, their width (None: d_expert), their gate.
        token_rounding, rounding_tile, rounding_max_experts: token rounding's rule, tile and experts per token.
        device, dtype: of the parameters.

    Returns:
        forward(x (..., D)) -> MoEOutput: out of x's shape and dtype, aux_loss and z_loss fp32 scalars.
    """

    def __init__(self, d_model: int, d_expert: int, num_experts: int, top_k: int, *,
                 experts: ExpertsConfig = DEFAULT, scoring: str | None = None, renormalize: bool | None = None,
                 router: dict | str | None = None, shared_experts: int = 0, d_shared: int | None = None,
                 shared_gate: bool = False, token_rounding: str | None = None, rounding_tile: int | None = None,
                 rounding_max_experts: int | None = None, device=None, dtype=None, **legacy):
        super().__init__()
        for name, value in (("d_model", d_model), ("d_expert", d_expert), ("num_experts", num_experts),
                            ("top_k", top_k)):
            check_int(name, value)
        experts = from_legacy("MoELayer", experts, legacy)
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.router = TopKRouter(d_model, num_experts, top_k, **_router_options(router, scoring, renormalize),
                                 device=device)
        self.experts = Experts(d_model, d_expert, num_experts, config=experts, device=device, dtype=dtype)
        if token_rounding is not None:
            check_choice("token_rounding", token_rounding, RULES)
        self.token_rounding = token_rounding
        self.rounding_tile = check_int("rounding_tile", rounding_tile) if rounding_tile is not None else BLOCK_M
        self.rounding_max_experts = (check_int("rounding_max_experts", rounding_max_experts, minimum=top_k)
                                     if rounding_max_experts is not None else default_max_experts(num_experts, top_k))
        check_int("shared_experts", shared_experts, minimum=0)
        check_bool("shared_gate", shared_gate)
        if not shared_experts and (shared_gate or d_shared is not None):
            raise ValueError(f"{'shared_gate=True' if shared_gate else f'd_shared={d_shared}'} configures shared "
                             "experts, but shared_experts is 0")
        self.shared = None
        if shared_experts:
            self.shared = SharedExperts(d_model, d_shared or d_expert, shared_experts, config=experts,
                                        gated=shared_gate, device=device, dtype=dtype)
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
        if self.token_rounding is not None and self.training:
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
        L, K, E, M = r.topk_idx.shape[0], self.top_k, self.num_experts, self.rounding_tile
        rt = self.router
        rows = rounded_rows_bound(L, K, E, M, self.token_rounding)
        index, w, overflow = round_to_index(r.logits, r.topk_idx, r.topk_weights, M, self.token_rounding, rt.scoring,
                                            rt.renormalize, rt.route_scale, max_experts=self.rounding_max_experts,
                                            max_rows=rows, check=False)  # the router's own ids and weights
        # the rounding keeps both bounds by construction: an overflow here is a bug, never a silent drop
        fail_if(overflow, f"token rounding: the rounded pairs overflow the index's bounds (rounding_max_experts="
                f"{self.rounding_max_experts}, rows {rows})", RuntimeError)  # a device-side assert: no host sync
        return w, index

    def extra_repr(self) -> str:
        rounding = f", token_rounding={self.token_rounding} (tile {self.rounding_tile})" if self.token_rounding else ""
        return f"top_k={self.top_k}{rounding}"


def _router_options(router: dict | str | None, scoring: str | None, renormalize: bool | None) -> dict:
    """TopKRouter's options: a family's set by name (moeblaze.routing.ROUTERS) or a dict, with scoring and
    renormalize given beside it only where the set does not say them otherwise."""
    if isinstance(router, str):
        check_choice("router", router, tuple(ROUTERS))
        router = ROUTERS[router]
    if router is not None and not isinstance(router, dict):
        raise TypeError(f"router must be a family's name (moeblaze.routing.ROUTERS) or a dict of TopKRouter options, "
                        f"got {type(router).__name__}")
    options = dict(router or {})
    for name, value in (("scoring", scoring), ("renormalize", renormalize)):
        if value is None:
            continue
        if name in options and options[name] != value:
            raise ValueError(f"{name}={value!r} contradicts the router's {name}={options[name]!r}: give it once")
        options[name] = value
    return options


def _earlier_expert_keys(state_dict, prefix, *_args) -> None:
    """State dicts from before the experts submodule kept w1 and w2 on the layer: rename them."""
    for name in ("w1", "w2"):
        if prefix + name in state_dict:
            state_dict[prefix + "experts." + name] = state_dict.pop(prefix + name)
