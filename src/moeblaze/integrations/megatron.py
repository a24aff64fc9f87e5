"""moeblaze inside Megatron-Core (0.16-0.19): its layer spec, the official extension point.

    from megatron.core.models.gpt import GPTModel
    from moeblaze import ExpertsConfig
    from moeblaze.integrations.megatron import get_moeblaze_gpt_layer_spec

    spec = get_moeblaze_gpt_layer_spec(num_experts=128, experts=ExpertsConfig(checkpoint="recompute"))
    model = GPTModel(config, transformer_layer_spec=spec, ...)

The spec is Megatron's own (get_gpt_layer_local_spec, or the TransformerEngine one with use_te=True) with the MoE
layer's MLP swapped: Megatron's router (its probs, routing map and auxiliary-loss hooks), its shared experts and its
experts module (SequentialMLP: the same parameters, names, sharded_state_dict and dist-checkpointing, so a
checkpoint saved with moeblaze loads in stock Megatron and back) stay; what runs between the router and the shared
experts' sum is moeblaze's (under dispatch="moeblaze" the layer is MoeblazeTransformerLayer, Megatron's with its
process groups handed to the MoE layer, which 0.16's hands only to Megatron's own MLP classes):

  dispatch="moeblaze" (default)  MoeblazeMoELayer: permute -> experts -> unpermute replaced by one moe_experts call on
                                 the routing index built from Megatron's routing map (no permuted copy of the
                                 tokens); under expert parallelism (pg_collection.ep larger than one) moeblaze's own
                                 (ep_experts over that group, EPConfig's dispatch), in place of Megatron's dispatcher
  dispatch="megatron"            Megatron's MoELayer and token dispatcher (allgather, alltoall, flex: DeepEP,
                                 HybridEP), and moeblaze's op computing the permuted rows it hands over, one row per
                                 expert (MoeblazeSequentialMLP)

An expert computes p · (W2 act(W1 x + b1) + b2), Megatron's arithmetic (its SequentialMLP applies p to the
activation and to b2). The activation is the Megatron config's (gated_linear_unit with silu or gelu; silu, gelu,
relu, squared_relu).

Refused by name when the layer is built (never computed differently): expert tensor parallelism > 1, TE's fp8/fp4
recipes (moeblaze's ExpertsConfig(precision="fp8") instead), moe_layer_recompute (ExpertsConfig(checkpoint=
"recompute") instead), CUDA-graph capture of the MoE layer, overlap_moe_expert_parallel_comm, moe_latent_size,
moe_apply_probs_on_input, an activation clamp or GLU offset, experts other than SequentialMLP (TEGroupedMLP: the
spec picks SequentialMLP); with dispatch="moeblaze" also capacity drops (moe_expert_capacity_factor),
moe_shared_expert_overlap (a dispatcher feature), the flex dispatcher (moeblaze moves the tokens itself), tensor
parallelism > 1, and biases under expert parallelism.

Memory contract: per layer call, the routing index (O(T·K) int32) and what moe_experts keeps under the checkpoint
policy. The experts' parameters (SequentialMLP's, each expert's apart) sit back to back in one storage per kind,
laid out when built and after .to()/.cuda(): the op reads its (E, F, D) and (E, D, H) operands there in place. Laid
out otherwise (Megatron's distributed optimizer's buffer, last first), they are stacked per call and saved for
backward as a recipe (saved-tensor hooks restack them there): nothing of the weights' size outlives forward. Under
Megatron's DistributedDataParallel their gradients are added into its buffer in one launch per kind
(megatron_weights).
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib.util
import inspect

import torch
import torch.nn.functional as F

from ..args import check_choice, check_int
from ..configs import DEFAULT, EPConfig, ExpertsConfig, check_config
from ..experts import autocast_operands, autocast_weights, routed_call
from .megatron_weights import _InPlace, _join, _joined, _restacked, _stack

try:
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("moeblaze.integrations.megatron needs Megatron-Core 0.16-0.19: pip install megatron-core") from e

DISPATCH = ("moeblaze", "megatron")
_ACTIVATIONS = {(F.silu, True): "swiglu", (F.gelu, True): "geglu", (F.silu, False): "silu",
                (F.gelu, False): "gelu", (F.relu, False): "relu", (squared_relu, False): "relu2"}


def activation_of(config) -> str:
    """moeblaze's name for the experts' activation of a Megatron TransformerConfig; ValueError where moeblaze has
    none that computes the same function."""
    name = _ACTIVATIONS.get((config.activation_func, bool(config.gated_linear_unit)))
    if name is None:
        raise ValueError(f"activation_func={getattr(config.activation_func, '__name__', config.activation_func)} "
                         f"with gated_linear_unit={config.gated_linear_unit}: moeblaze's experts compute SwiGLU, "
                         "GeGLU, SiLU, GELU, ReLU and squared ReLU")
    if getattr(config, "activation_func_clamp_value", None) is not None or getattr(config, "glu_linear_offset", 0):
        raise ValueError("activation_func_clamp_value and glu_linear_offset are not moeblaze's activations: leave "
                         "them unset")
    return name


def _graph_scopes(config) -> list[str]:
    """cuda_graph_scope as lower-case names (empty, or "full": the whole layer)."""
    scope = getattr(config, "cuda_graph_scope", None) or []
    scope = scope if isinstance(scope, (list, tuple)) else [scope]
    return [str(getattr(s, "name", s)).lower() for s in scope]


def check_megatron_config(config, dispatch: str) -> None:
    """ValueError naming the option unless moeblaze computes this Megatron TransformerConfig's MoE layer as Megatron
    would (the module header's refusals).

    Args:
        config: Megatron's TransformerConfig.
        dispatch: "megatron" (its dispatcher around moeblaze's experts) or "moeblaze" (moeblaze's layer).

    Returns:
        None.
    """
    check_choice("dispatch", dispatch, DISPATCH)
    refusals = [
        ((getattr(config, "expert_tensor_parallel_size", None) or 1) > 1,
         "expert_tensor_parallel_size > 1: moeblaze's experts are whole on each rank (use expert parallelism)"),
        (bool(getattr(config, "fp8", None) or getattr(config, "fp4", None)),
         "TransformerEngine's fp8/fp4 recipes do not reach moeblaze's experts: use ExpertsConfig(precision='fp8')"),
        (config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or []),
         "recompute_modules with 'moe' (moe_layer_recompute): use ExpertsConfig(checkpoint='recompute'), which "
         "keeps no activation of the experts"),
        (getattr(config, "cuda_graph_impl", "none") not in (None, "none")
         and (not _graph_scopes(config) or any(s not in ("attn", "mamba") for s in _graph_scopes(config))),
         "CUDA-graph capture of the MoE layer (cuda_graph_scope) is not supported with moeblaze's layer"),
        (bool(getattr(config, "overlap_moe_expert_parallel_comm", False)),
         "overlap_moe_expert_parallel_comm calls the MoE layer's stages one by one: not with moeblaze's layer"),
        (bool(getattr(config, "moe_latent_size", None)), "moe_latent_size is not supported by moeblaze's layer"),
        (bool(config.moe_apply_probs_on_input), "moe_apply_probs_on_input is not supported by moeblaze's layer"),
    ]
    if dispatch == "moeblaze":
        refusals += [
            (config.moe_expert_capacity_factor is not None,
             "moe_expert_capacity_factor (capacity drops) with dispatch='moeblaze': every routed pair is computed; "
             "use dispatch='megatron' for Megatron's capacity, or moeblaze's EPConfig(dispatch='capacity')"),
            (bool(config.moe_shared_expert_overlap),
             "moe_shared_expert_overlap is a Megatron dispatcher's feature: use dispatch='megatron'"),
            (getattr(config, "moe_token_dispatcher_type", None) == "flex",
             "moe_token_dispatcher_type='flex' (DeepEP, HybridEP) would be built and never run: dispatch='moeblaze' "
             "moves the tokens itself; use dispatch='megatron' to keep Megatron's flex dispatcher"),
            (config.tensor_model_parallel_size > 1,
             "tensor_model_parallel_size > 1 with dispatch='moeblaze': use dispatch='megatron' (its dispatcher "
             "gathers the sequence-parallel tokens)"),
        ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"moeblaze's Megatron layer: {why}")
    activation_of(config)


def _experts_config(experts: ExpertsConfig | None, megatron_config) -> ExpertsConfig:
    experts = check_config("experts", experts, ExpertsConfig) or DEFAULT
    activation = activation_of(megatron_config)
    if experts.activation not in (DEFAULT.activation, activation):
        raise ValueError(f"experts=ExpertsConfig(activation={experts.activation!r}), but the Megatron config's "
                         f"experts compute {activation!r}: the activation is the Megatron config's, leave it unset")
    if experts.fp8_weight_cache:
        raise ValueError("fp8_weight_cache=True: Megatron keeps each expert's weights apart, and the experts' "
                         "operand over them is a new tensor every call; use precision='fp8' without it")
    return dataclasses.replace(experts, activation=activation)


_UNREGISTERED = object()


def _param(module, name: str):
    """module.<name>: its registered parameter, else the attribute (a plain tensor or None)."""
    p = module._parameters.get(name, _UNREGISTERED)
    return getattr(module, name) if p is _UNREGISTERED else p


class MoeblazeSequentialMLP(SequentialMLP):
    """Megatron's SequentialMLP (its parameters, names and sharded_state_dict) computed by moeblaze's op: called by
    Megatron's dispatcher on the permuted rows (dispatch="megatron"), or by MoeblazeMoELayer on the tokens and the
    routing index (dispatch="moeblaze").

    Args:
        num_local_experts: this rank's experts.
        config: Megatron's TransformerConfig (check_megatron_config).
        moeblaze: the experts' recipe, a moeblaze.ExpertsConfig.
        dispatch: "megatron" or "moeblaze" (above).

    Returns:
        A module whose forward(permuted_tokens, tokens_per_expert, permuted_probs) returns (output, None) as
        SequentialMLP's does.
    """

    def __init__(self, num_local_experts, config, *args, moeblaze: ExpertsConfig = DEFAULT,
                 dispatch: str = "megatron", **kwargs):
        check_megatron_config(config, dispatch)
        experts = _experts_config(moeblaze, config)
        super().__init__(num_local_experts, config, *args, **kwargs)
        self.moeblaze_config = experts
        self._join_parts()
        group = getattr(self, "ep_group", None)
        if group is not None and group.size() > 1:  # dispatchers that differ make different collectives: a hang
            from ..distributed.ep import check_agreement
            check_agreement(group, dispatch=dispatch, recipe=experts, experts=num_local_experts)

    def _join_parts(self) -> None:
        """Each kind of parameter (fc1's weights, fc2's, each bias) in one storage, expert after expert."""
        self._layouts = {}  # kind -> ((dtype, addresses), joined) of the layout last checked in full
        for parts in self._parts():
            if parts is not None and not _joined(parts):
                _join(parts)

    def _operand(self, kind: int, parts: tuple) -> torch.Tensor:
        """One kind of the experts' parameters as the op's (E, ...) operand: their storage, read in place, where they
        are joined (checked in full once per layout, known again by its addresses), else a stacked copy."""
        seen = (parts[0].dtype, [p.data_ptr() for p in parts])
        last = self._layouts.get(kind)
        if last is None or last[0] != seen:
            last = self._layouts[kind] = (seen, _joined(parts))
        return _InPlace.apply(*parts) if last[1] else _stack(parts)

    def _apply(self, fn, *args, **kwargs):  # .to(), .cuda(), .bfloat16() make each parameter anew: join them again
        out = super()._apply(fn, *args, **kwargs)
        self._join_parts()
        return out

    def _parts(self) -> tuple:
        """(fc1's weights, fc2's, fc1's biases or None, fc2's or None), expert by expert: read from the modules'
        own tables (nn.Module's attribute lookup costs ~0.5 ms a call over 128 experts' 512 names)."""
        experts = self.local_experts._modules.values()
        fc1, fc2 = [e._modules["linear_fc1"] for e in experts], [e._modules["linear_fc2"] for e in experts]
        biases = tuple(None if _param(fc[0], "bias") is None else tuple(_param(f, "bias") for f in fc)
                       for fc in (fc1, fc2))
        return tuple(_param(f, "weight") for f in fc1), tuple(_param(f, "weight") for f in fc2), *biases

    def routed(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, group=None,
               ep: EPConfig | None = None, sentinels: bool = False) -> torch.Tensor:
        """sum_k weights[t, k] · expert_{ids[t, k]}(x[t]) (T, D) in x's dtype: this rank's experts, or under a
        group (expert parallelism) the group's, ids global (ids >= E where sentinels: pairs that add nothing)."""
        w1s, w2s, b1s, b2s = self._parts()
        config, weights = self.moeblaze_config, weights_TK.to(torch.float32)
        parts = [w1s, w2s] + ([b1s, b2s] if b1s is not None else [])
        stacked = [self._operand(kind, p) for kind, p in enumerate(parts)]
        x, *biases = autocast_operands(x_TD, *stacked[2:])
        operands = [*autocast_weights(config, *stacked[:2]), *biases]  # fp8: float32 stacks stay float32
        across = None
        if group is not None:
            from ..distributed import ep_experts
            across = functools.partial(ep_experts, group=group, experts=config, ep_config=ep)
        with _restacked({o: p for o, p in zip(operands, parts)  # stacked or cast here (routed_call casts none)
                         if o.untyped_storage().data_ptr() != p[0].untyped_storage().data_ptr()}):
            return routed_call(x, ids_TK, weights, *operands, experts=config, sentinels=sentinels, across=across,
                                  out_dtype=x_TD.dtype)

    def forward(self, permuted_TD: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor,
                **_):
        """SequentialMLP's call on rows grouped by expert: (out, None), each row through its expert once, times its
        prob."""
        R, E = permuted_TD.shape[0], self.num_local_experts
        counts = torch.as_tensor(tokens_per_expert, device=permuted_TD.device)
        ids = torch.repeat_interleave(torch.arange(E, device=permuted_TD.device), counts, output_size=R)
        return self.routed(permuted_TD, ids[:, None], permuted_probs[:, None]), None


_LAYER_GROUPS = contextvars.ContextVar("moeblaze_layer_groups", default=None)  # a layer's pg_collection, built


class MoeblazeTransformerLayer(TransformerLayer):
    """Megatron's TransformerLayer whose process groups (its pg_collection) reach moeblaze's MoE layer as they reach
    Megatron's own: Megatron-Core 0.16's TransformerLayer hands them only to the MLP classes it names (MoELayer
    itself, not a subclass), so moeblaze's layer would take the global parallel state (another expert-parallel size
    than the model's, unsaid). The spec helpers build the layer with it; everything else is TransformerLayer's."""

    def __init__(self, *args, **kwargs):
        groups = inspect.signature(TransformerLayer.__init__).bind(self, *args, **kwargs).arguments.get(
            "pg_collection")
        token = _LAYER_GROUPS.set(groups)
        try:
            super().__init__(*args, **kwargs)
        finally:
            _LAYER_GROUPS.reset(token)


class MoeblazeMoELayer(MoELayer):
    """Megatron's MoELayer with permute -> experts -> unpermute (and, under expert parallelism, its dispatcher)
    replaced by moeblaze's op on the routing index (the module header). Megatron's spec builds it
    (get_moeblaze_gpt_layer_spec); the ranks of an expert-parallel group check that they agree when it is built.

    Args:
        config: Megatron's TransformerConfig (check_megatron_config).
        moeblaze: the experts' recipe, a moeblaze.ExpertsConfig.
        ep: under expert parallelism, moeblaze's own (a moeblaze.EPConfig; None: its exact dispatch).

    Returns:
        A module whose forward(hidden_states) returns (output, None) as Megatron's MoELayer does.
    """

    def __init__(self, config, *args, moeblaze: ExpertsConfig = DEFAULT, ep: EPConfig | None = None, **kwargs):
        check_megatron_config(config, "moeblaze")
        _experts_config(moeblaze, config)
        if kwargs.get("pg_collection") is None and len(args) < 3:  # not handed over: the layer's (see above)
            kwargs["pg_collection"] = _LAYER_GROUPS.get()
        super().__init__(config, *args, **kwargs)
        if not isinstance(self.experts, MoeblazeSequentialMLP):
            raise ValueError(f"the experts module is {type(self.experts).__qualname__}: moeblaze's layer computes "
                             "Megatron's SequentialMLP (get_moeblaze_gpt_layer_spec builds it)")
        self.ep_group = self.experts.ep_group
        self.ep = check_config("ep", ep, EPConfig)
        if self.ep_group.size() > 1:
            from ..distributed.ep import check_agreement, check_options
            check_agreement(self.ep_group, ep_config=self.ep or EPConfig())
            check_options(self.experts.moeblaze_config)
            if self.config.add_bias_linear:
                raise ValueError("moeblaze's layer: expert biases (add_bias_linear) under expert parallelism are not "
                                 "supported; use dispatch='megatron'")
        elif ep is not None:
            raise ValueError("ep (moeblaze's expert-parallel dispatch) is given, but the expert-parallel group has one "
                             "rank")

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        """(output, None) as MoELayer's: the shared experts and the router as Megatron computes them, the routed
        experts as one moeblaze call."""
        if intermediate_tensors is not None:
            raise ValueError("moeblaze's layer runs whole: partial CUDA-graph capture (intermediate_tensors) is not "
                             "supported")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        shared = self.shared_experts_compute(hidden_states)
        probs_TE, map_TE = self.route(hidden_states, padding_mask)
        x_TD = hidden_states.reshape(-1, hidden_states.shape[-1])
        K = self.config.moe_router_topk
        # the routed experts of each token first (ascending ids), then unrouted ones: K distinct ids a token, those
        # past its routed ones (a padding mask leaves fewer) marked invalid
        valid_TK, ids_TK = map_TE.to(torch.uint8).sort(dim=1, descending=True, stable=True)
        valid_TK, ids_TK = valid_TK[:, :K].bool(), ids_TK[:, :K]
        weights_TK = probs_TE.gather(1, ids_TK) * valid_TK
        if self.ep_group.size() > 1:  # invalid pairs run at weight 0: expert parallelism takes no sentinels
            out = self.experts.routed(x_TD, ids_TK, weights_TK, group=self.ep_group, ep=self.ep)
        else:
            ids_TK = torch.where(valid_TK, ids_TK, probs_TE.shape[1])
            out = self.experts.routed(x_TD, ids_TK, weights_TK, sentinels=True)
        out = out.view(hidden_states.shape)
        return (out if shared is None else out + shared), None


def _swap(builder, cls, submodules=None, **params):
    """A Megatron builder (0.16's ModuleSpec, 0.19's partial) of cls instead, params added, and its submodules
    replaced where given."""
    if isinstance(builder, ModuleSpec):
        return dataclasses.replace(builder, module=cls, params={**builder.params, **params},
                                   submodules=builder.submodules if submodules is None else submodules)
    if isinstance(builder, functools.partial):
        given = {} if submodules is None else {"submodules": submodules}
        return functools.partial(cls, *builder.args, **{**builder.keywords, **params, **given})
    raise TypeError(f"unexpected Megatron builder {builder!r}")


def _submodules(builder):
    return builder.submodules if isinstance(builder, ModuleSpec) else builder.keywords["submodules"]


def _module(builder):
    return builder.module if isinstance(builder, ModuleSpec) else builder.func


def _is_moe(builder) -> bool:
    """Whether a spec's MLP builder makes an MoE layer (0.19 builds dense MLPs through a classmethod, not a class)."""
    module = _module(builder)
    return isinstance(module, type) and issubclass(module, MoELayer)


def get_moeblaze_gpt_layer_spec(num_experts: int, *, experts: ExpertsConfig = DEFAULT, dispatch: str = "moeblaze",
                                ep: EPConfig | None = None, use_te: bool = False, **spec_kwargs):
    """Megatron's GPT layer spec (get_gpt_layer_local_spec, or with use_te get_gpt_layer_with_transformer_engine_spec;
    spec_kwargs go to it) with its MoE layer on moeblaze (the module header).

    Args:
        num_experts: the model's routed experts (Megatron's num_moe_experts).
        experts: moeblaze's recipe for the experts (checkpoint policy, precision, backend, chunking; None: the
            default); the activation is the Megatron config's.
        dispatch: "moeblaze" (the fused layer; under expert parallelism moeblaze's dispatch) or "megatron"
            (Megatron's layer and dispatcher, moeblaze's op on the permuted rows).
        ep: moeblaze's expert-parallel dispatch (EPConfig; None: exact), dispatch="moeblaze" only.
        use_te: start from the TransformerEngine spec (attention and norms on TE; the experts stay SequentialMLP).

    Returns:
        The TransformerLayer spec, for GPTModel(transformer_layer_spec=...).
    """
    check_int("num_experts", num_experts)
    _check_spec_options(experts, dispatch, ep, use_te)
    if spec_kwargs.pop("moe_grouped_gemm", False):
        raise ValueError("moe_grouped_gemm=True builds Megatron's grouped-GEMM experts (TEGroupedMLP, GroupedMLP), "
                         "whose parameters moeblaze's layer doesn't compute: leave it out (moeblaze's experts are one "
                         "grouped launch over SequentialMLP's parameters)")
    from megatron.core.models.gpt import gpt_layer_specs
    make = (gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec if use_te
            else gpt_layer_specs.get_gpt_layer_local_spec)
    spec = make(num_experts=num_experts, moe_grouped_gemm=False, **spec_kwargs)
    mlp = spec.submodules.mlp
    if not _is_moe(mlp):
        raise ValueError(f"Megatron's spec has {_module(mlp)!r} as the MLP: no MoE layer to put moeblaze in")
    return _on_moeblaze(spec, experts, dispatch, ep)


def _check_spec_options(experts, dispatch: str, ep, use_te: bool) -> None:
    """The options both spec helpers take, checked once: the recipe, the dispatch, ep under it, TE where asked."""
    check_choice("dispatch", dispatch, DISPATCH)
    check_config("experts", experts, ExpertsConfig)
    if check_config("ep", ep, EPConfig) is not None and dispatch != "moeblaze":
        raise ValueError("ep is moeblaze's expert-parallel dispatch: it applies to dispatch='moeblaze'")
    if use_te and importlib.util.find_spec("transformer_engine") is None:
        raise ValueError("use_te=True starts from Megatron's TransformerEngine spec, and TransformerEngine is not "
                         "installed: install it (pip install transformer-engine[pytorch]) or leave use_te out")


def _on_moeblaze(spec, experts: ExpertsConfig, dispatch: str, ep: EPConfig | None):
    """A TransformerLayer spec of Megatron's whose MLP is its MoE layer, with that layer on moeblaze."""
    mlp = spec.submodules.mlp
    subs = _submodules(mlp)
    if _module(subs.experts) is not SequentialMLP:
        raise ValueError(f"Megatron's spec has {_module(subs.experts).__qualname__} as the experts: moeblaze computes "
                         "SequentialMLP's parameters")
    subs = dataclasses.replace(subs, experts=_swap(subs.experts, MoeblazeSequentialMLP, moeblaze=experts,
                                                   dispatch=dispatch))
    if dispatch == "moeblaze":
        mlp = _swap(mlp, MoeblazeMoELayer, subs, moeblaze=experts, ep=ep)
        if spec.module is TransformerLayer:  # its process groups reach the MoE layer (MoeblazeTransformerLayer)
            spec = dataclasses.replace(spec, module=MoeblazeTransformerLayer)
    else:
        mlp = _swap(mlp, _module(mlp), subs)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))


def get_moeblaze_gpt_decoder_block_spec(config, *, experts: ExpertsConfig = DEFAULT, dispatch: str = "moeblaze",
                                        ep: EPConfig | None = None, use_te: bool = False, **block_kwargs):
    """Megatron's GPT decoder block spec (get_gpt_decoder_block_spec: dense and MoE layers as config.moe_layer_freq
    lays them out, this pipeline stage's slice; block_kwargs go to it) with every MoE layer on moeblaze, the dense
    layers Megatron's: for models whose first layers are dense (DeepSeek-V3's first three) or that interleave them.
    Multi-token prediction: pass this block's last layer spec to Megatron's get_gpt_mtp_block_spec.

    Args:
        config: the model's TransformerConfig (num_layers, moe_layer_freq, num_moe_experts, ...).
        experts, dispatch, ep, use_te: as for get_moeblaze_gpt_layer_spec.

    Returns:
        The TransformerBlockSubmodules, for GPTModel(transformer_layer_spec=...).
    """
    _check_spec_options(experts, dispatch, ep, use_te)
    if not config.num_moe_experts:
        raise ValueError("config.num_moe_experts is not set: the block has no MoE layer to put moeblaze in (use "
                         "Megatron's get_gpt_decoder_block_spec for a dense model)")
    if config.moe_grouped_gemm:
        raise ValueError("config.moe_grouped_gemm=True builds Megatron's grouped-GEMM experts (TEGroupedMLP, "
                         "GroupedMLP), whose parameters moeblaze's layer doesn't compute: set it False")
    from megatron.core.models.gpt import gpt_layer_specs
    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, **block_kwargs)
    layers = [_on_moeblaze(s, experts, dispatch, ep) if _is_moe(s.submodules.mlp) else s
              for s in block.layer_specs]
    return dataclasses.replace(block, layer_specs=layers)


__all__ = ["MoeblazeMoELayer", "MoeblazeSequentialMLP", "check_megatron_config", "get_moeblaze_gpt_decoder_block_spec",
           "get_moeblaze_gpt_layer_spec"]
