"""moeblaze as torchtitan's routed experts (torchtitan 0.3): a model converter, torchtitan's own idiom.

    from torchtitan.models import qwen3
    from moeblaze import ExpertsConfig
    from moeblaze.integrations.torchtitan import MoeblazeConverter

    spec = qwen3.model_registry("30B-A3B", converters=[
        MoeblazeConverter.Config(experts=ExpertsConfig(checkpoint="recompute"))])

The converter replaces every RoutedExperts.Config of the model (its token dispatcher and GroupedExperts) by
moeblaze's: the same submodules, parameters and names (routed_experts.inner_experts.w1_EFD, w2_EDF, w3_EFD), so
torchtitan's state dicts and DCP checkpoints load in either direction, and torchtitan's router, load balancing (the
expert-bias update from tokens_per_expert_E), shared experts, initialization and FSDP2 wrapping are untouched.

Without expert parallelism a layer is moeblaze's fused op on the routing index: no (T·K, D) copy of the routed
tokens, the scores applied in the combine in fp32, SwiGLU in the up GEMM's epilogue, the ExpertsConfig's
checkpoint policy and precision; w1 (gate) and w3 (up) are W1's two parts (moe_experts). Under torchtitan's
expert parallelism (an EP mesh), torchtitan's all-to-all dispatcher moves the routed rows and moeblaze's op
computes the received rows, grouped by expert, in place of grouped_mm (ep_dispatch="torchtitan", the default); or
moeblaze's own expert parallelism (moeblaze.distributed.ep_experts) moves the rows over torchtitan's EP mesh from the
routing index instead of torchtitan's dispatcher (ep_dispatch="exact" or "capacity", with capacity_factor and
on_overflow as ep_experts takes them; w1 and w3 of the local experts go in as they are, no copy kept).

The experts compute in x's dtype (bf16 under FSDP2's mixed precision), or in autocast's where it is on;
torchtitan's grouped_mm path casts to bf16 whatever x is.

Refused by name: tensor parallelism (at parallelize), experts other than GroupedExperts (gpt-oss's, ones another
converter made), dispatchers other than the local and all-to-all ones (DeepEP, HybridEP, the padded one for
torchao), an activation other than SwiGLU, fp8_weight_cache (FSDP2 gathers the weights anew every step).
Pipeline parallelism (torchtitan's pipeline_llm) splits whole layers into stages and runs with moeblaze's experts
in them unchanged.

Memory contract: per MoE layer call, the routing index (O(T·K) int32) and what moe_experts keeps under the
checkpoint policy. w1 and w3 are read in place by Hopper's kernels in bf16/fp16 (F a multiple of 128); elsewhere
(the portable kernels, precision="fp8") W1 = [w1 | w3] is a transient (E·2F·D elements, in forward and again in
backward, never kept).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch

from ..configs import DEFAULT, EPConfig, ExpertsConfig, check_config
from ..distributed.ep import check_options
from ..experts import routed_call


try:
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
    from torchtitan.protocols.model import ModelConfigConverter
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("moeblaze.integrations.torchtitan needs torchtitan >= 0.3 (its model converters and "
                      "RoutedExperts): pip install 'moeblaze[torchtitan]'") from e

DISPATCHERS = (LocalTokenDispatcher.Config, AllToAllTokenDispatcher.Config)


def check_experts_config(config: ExpertsConfig | None) -> ExpertsConfig:
    """config (None: the default), if torchtitan's experts can run on it: SwiGLU, no fp8_weight_cache."""
    config = check_config("experts", config, ExpertsConfig) or DEFAULT
    if config.activation != "swiglu":
        raise ValueError(f"torchtitan's GroupedExperts compute SwiGLU; experts=ExpertsConfig(activation="
                         f"{config.activation!r}) would compute another function")
    if config.fp8_weight_cache:
        raise ValueError("fp8_weight_cache=True can't be used in torchtitan: FSDP2 gathers the expert weights anew "
                         "every step; use precision='fp8' without it")
    return config


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class MoeblazeGroupedExperts(GroupedExperts):
    """torchtitan's GroupedExperts (its parameters w1_EFD, w2_EDF, w3_EFD) computed by moeblaze's op.

    Args:
        config: its Config: GroupedExperts.Config's fields and `experts`, the recipe (a moeblaze.ExpertsConfig).

    Returns:
        A module whose forward(x_RD, num_tokens_per_expert_E) runs rows grouped by expert as GroupedExperts' does, and
        whose routed(x, expert_ids, scores) runs tokens on their top-k experts.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        experts: ExpertsConfig = DEFAULT

    def __init__(self, config: Config):
        super().__init__(config)
        self.moeblaze_config = check_experts_config(config.experts)

    def weights(self) -> tuple:
        """(w1, w2, w3): this rank's experts (the EP shard's local part)."""
        return _local(self.w1_EFD), _local(self.w2_EDF), _local(self.w3_EFD)

    def routed(self, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, scores_TK: torch.Tensor) -> torch.Tensor:
        """sum_k scores[t, k] · expert_{ids[t, k]}(x[t]): (T, D) in x's dtype."""
        w1, w2, w3 = self.weights()
        return routed_call(x_TD, expert_ids_TK, scores_TK.to(torch.float32), (w1, w3), w2,
                              experts=self.moeblaze_config, out_dtype=x_TD.dtype)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """GroupedExperts' call on rows grouped by expert (what torchtitan's dispatchers hand over): each row
        through its expert once."""
        R, E = x_RD.shape[0], num_tokens_per_expert_E.shape[0]
        ids = torch.repeat_interleave(torch.arange(E, device=x_RD.device), num_tokens_per_expert_E, output_size=R)
        return self.routed(x_RD, ids[:, None], x_RD.new_ones(R, 1, dtype=torch.float32))


class MoeblazeRoutedExperts(RoutedExperts):
    """torchtitan's RoutedExperts: without an EP mesh, moeblaze's fused op on the routing index (no dispatch,
    no routed-token copy, no scatter_add); with one, torchtitan's dispatcher around moeblaze's experts, or
    moeblaze's own expert parallelism where the Config's `ep` is a moeblaze.EPConfig.

    Args:
        config: its Config: RoutedExperts.Config's fields and `ep` (None or a moeblaze.EPConfig).

    Returns:
        A module whose forward takes and returns what RoutedExperts' does.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        ep: EPConfig | None = None  # moeblaze's expert parallelism (None: torchtitan's dispatcher)

    def __init__(self, config: Config):
        super().__init__(config)
        self.ep = config.ep

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        mesh = getattr(self.token_dispatcher, "ep_mesh", None)
        if mesh is not None and self.ep is None:
            return super().forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
        B, L, D = x_BLD.shape
        K = topk_expert_ids_BLK.shape[-1]
        x_TD, ids_TK, scores_TK = (x_BLD.reshape(B * L, D), topk_expert_ids_BLK.reshape(B * L, K),
                                   topk_scores_BLK.reshape(B * L, K))
        if mesh is None:
            out = self.inner_experts.routed(x_TD, ids_TK, scores_TK)
        else:
            out = self._moeblaze_ep(x_TD, ids_TK, scores_TK, mesh)
        return out.view(B, -1, D)

    def _moeblaze_ep(self, x_TD, ids_TK, scores_TK, mesh) -> torch.Tensor:
        """moeblaze's expert parallelism over torchtitan's EP mesh: this rank's experts are torchtitan's EP shard,
        experts [r·E_loc, (r + 1)·E_loc) on the mesh's rank r, as ep_experts expects."""
        from ..distributed import ep_experts

        inner = self.inner_experts
        w1, w2, w3 = inner.weights()
        if w1.shape[0] * mesh.size() != inner.num_experts:
            raise RuntimeError(f"this rank holds {w1.shape[0]} of {inner.num_experts} experts over an EP mesh of "
                               f"{mesh.size()}: torchtitan's expert parallelism did not shard them (was the model "
                               "config's update_from_config called with the parallelism before building?)")
        across = functools.partial(ep_experts, group=mesh.get_group(), experts=inner.moeblaze_config,
                                   ep_config=self.ep)
        return routed_call(x_TD, ids_TK, scores_TK.to(torch.float32), (w1, w3), w2, experts=inner.moeblaze_config,
                              across=across, out_dtype=x_TD.dtype)

    def parallelize(self, parallel_dims) -> None:
        if parallel_dims.tp_enabled or getattr(parallel_dims, "etp_enabled", False):
            raise NotImplementedError("moeblaze's experts in torchtitan don't support tensor parallelism (it shards "
                                      "the experts' hidden dimension); use FSDP2 and expert parallelism")
        super().parallelize(parallel_dims)


class MoeblazeConverter(ModelConfigConverter):
    """A torchtitan model converter: every MoE layer's routed experts on moeblaze (see the module header).

    Args:
        config: its Config: `experts` (the recipe, a moeblaze.ExpertsConfig) and `ep` (under expert parallelism,
            None: torchtitan's dispatcher; a moeblaze.EPConfig: moeblaze's own).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        experts: ExpertsConfig = DEFAULT
        """moeblaze's recipe for the experts: checkpoint policy, backend, precision, chunk_tokens, index_method."""
        ep: EPConfig | None = None
        """Under expert parallelism, who moves the rows: None, torchtitan's all-to-all dispatcher (it feeds
        moeblaze's op the received rows), or moeblaze's own, as a moeblaze.EPConfig (dispatch "exact" or
        "capacity", capacity_factor, on_overflow, chunks, transport)."""

    def __init__(self, config: Config):
        self.config = config
        self.experts = check_experts_config(config.experts)
        self.ep = check_config("ep", config.ep, EPConfig)
        if self.ep is not None:
            check_options(self.experts)

    def convert(self, model_config):
        n = 0
        for fqn, config, parent, attr in list(model_config.traverse(RoutedExperts.Config)):
            if isinstance(config, MoeblazeRoutedExperts.Config):
                raise ValueError(f"{fqn or 'the model'}: already converted to moeblaze's experts")
            inner, dispatcher = config.inner_experts, config.token_dispatcher
            if type(inner) is not GroupedExperts.Config:
                raise ValueError(f"{fqn}.inner_experts is {type(inner).__qualname__}: moeblaze replaces torchtitan's "
                                 "GroupedExperts only (SwiGLU, no biases), not experts another converter or model made")
            if type(dispatcher) not in DISPATCHERS:
                raise ValueError(f"{fqn}.token_dispatcher is {type(dispatcher).__qualname__}: moeblaze runs with "
                                 "torchtitan's local and all-to-all dispatchers (moe_comm_backend 'standard')")
            new = MoeblazeRoutedExperts.Config(
                **{f.name: getattr(config, f.name) for f in fields(config) if f.name != "inner_experts"},
                ep=self.ep,
                inner_experts=MoeblazeGroupedExperts.Config(
                    **{f.name: getattr(inner, f.name) for f in fields(inner)}, experts=self.experts))
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            n += 1
        if n == 0:
            raise ValueError(f"{type(model_config).__qualname__} has no MoE layers (RoutedExperts): nothing would run "
                             "on moeblaze")
        return model_config


__all__ = ["MoeblazeConverter", "MoeblazeGroupedExperts", "MoeblazeRoutedExperts"]
