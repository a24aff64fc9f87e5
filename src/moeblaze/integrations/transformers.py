"""moeblaze as a Hugging Face transformers experts backend, named "moeblaze" (transformers >= 5.0).

    import moeblaze.integrations.transformers as mbt      # registers the backend (mbt.register() does it again)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="moeblaze")   # or from_pretrained(...)
    model.set_experts_implementation("moeblaze")          # or switch a model that is already built
    mbt.configure(model, ExpertsConfig(checkpoint="recompute"))   # optional: the experts' recipe

Every experts module of a model whose experts class carries transformers' `@use_experts_implementation` then
calls `experts_forward(module, hidden_states (T, H), top_k_index (T, K), top_k_weights (T, K))`. In the default
layout (gate_up_proj (E, 2I, H) with the I gate rows first, down_proj (E, H, I)) those parameters are
moe_experts' w1 and w2 as they are; transposed ones (gpt-oss: gate_up_proj (E, H, 2I), down_proj (E, I, H)) are
read through transposed views; biases are b1 and b2. Never copied (except by autocast's cast). gpt-oss's gate
(GptOssExperts._apply_gate) is moeblaze's clamped SwiGLU over interleaved gate/up columns. Expert ids >=
module.num_experts (transformers' expert-parallel sentinels) are dropped pairs of the routing index: skipped,
whatever their weight; a negative id is an error (a device-side assert on a GPU), as in transformers' eager
experts.

What moeblaze can't compute (any other custom `_apply_gate`, a post-expert norm, an activation without a kernel
such as tanh-GELU, interleaved columns under the default gate) runs on transformers' own `grouped_mm`
implementation, with one warning per experts class and reason: never a different function.

The recipe per experts module: the moeblaze.ExpertsConfig configure() sets on every one (attribute
moeblaze_config; the default ExpertsConfig() where none is set): checkpoint policy, backend ("auto": the Triton
kernels on CUDA, the PyTorch reference elsewhere), precision ("fp8": the expert GEMMs on e4m3, biases and gpt-oss's
layout included), chunk_tokens, index_method. Its activation is the module's own.

Memory contract: per call, the routing index (O(T·K) int32) and what moe_experts keeps under the policy.
"""
from __future__ import annotations

import functools
import warnings
import weakref

import torch

from ..experts import routed_call
from ..configs import DEFAULT, ExpertsConfig, from_legacy
from ..reference import CLAMP_ALPHA, CLAMP_LIMIT
from ..routing.checks import fail_if

MIN_VERSION = "5.0"
NAME = "moeblaze"
# transformers' hidden_act -> moeblaze's activation, with a gate (act(gate) * up) and without
GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}
PLAIN = {"silu": "silu", "swish": "silu", "gelu": "gelu", "relu": "relu", "relu2": "relu2"}
_warned: set = set()
_moe = None  # transformers.integrations.moe, once found
_act_types: dict = {}  # hidden_act -> the class transformers builds for it


def _interface():
    global _moe
    if _moe is not None:
        return _moe
    try:
        import transformers
    except ImportError as e:
        raise ImportError("moeblaze's transformers backend needs transformers >= 5.0: "
                          "pip install 'moeblaze[transformers]'") from e
    try:
        from transformers.integrations import moe
        moe.ExpertsInterface, moe.use_experts_implementation  # noqa: B018
    except (ImportError, AttributeError) as e:
        raise ImportError(f"moeblaze's transformers backend needs transformers >= {MIN_VERSION} (its experts "
                          f"interface); found transformers {transformers.__version__}") from e
    _moe = moe
    return moe


def register() -> None:
    """Register experts_forward as transformers' experts implementation "moeblaze" (idempotent), and have a model
    built with it that has no experts module say so (_warn_when_nothing_runs). Importing this module calls it.

    Args:
        (none)

    Returns:
        None.
    """
    _interface().ExpertsInterface.register(NAME, experts_forward)
    from transformers import PreTrainedModel

    check = getattr(PreTrainedModel, "get_correct_experts_implementation", None)
    if check is not None and not getattr(check, "_moeblaze", False):
        PreTrainedModel.get_correct_experts_implementation = _warn_when_nothing_runs(check)


def _warn_when_nothing_runs(check):
    """transformers' check of a model's experts implementation (run as each model starts to be built, before its
    modules exist), which refuses "grouped_mm" for a model class that can't set one (its modeling code uses no
    `@use_experts_implementation`) but takes any registered name: the same check, plus a warning where the name is
    "moeblaze" and the class can't set it, so that nothing in the model would run on moeblaze."""
    warned: dict = {}  # id -> weak reference of the configs warned about: a model and the model it wraps share one

    @functools.wraps(check)
    def checked(self, requested_experts):
        applicable = check(self, requested_experts)
        config = getattr(self, "config", None)
        seen = warned.get(id(config))
        if applicable == NAME and not self._can_set_experts_implementation() and (seen is None or seen() is not config):
            warned[id(config)] = weakref.ref(config) if config is not None else (lambda: None)
            warnings.warn(f"{type(self).__name__} was built with experts_implementation={NAME!r} but has no experts "
                          "module of transformers' experts interface: nothing in it runs on moeblaze", UserWarning,
                          stacklevel=2)
        return applicable

    checked._moeblaze = True
    return checked


def configure(model: torch.nn.Module, experts: ExpertsConfig | None = None, **legacy) -> int:
    """Run every experts module of `model` with the recipe `experts` (moeblaze.ExpertsConfig, its activation left
    unset: each module's own is read from it, as activation_of says, and another is refused); the number of experts
    modules set.
    config= (0.2's name for `experts`) and 0.1's keyword options (checkpoint=, impl=, ...) still work, with a
    DeprecationWarning.

    Args:
        model: a transformers model, or one experts module.
        experts: the recipe, a moeblaze.ExpertsConfig without an activation (None: the default recipe).

    Returns:
        The number of experts modules that will run it (once the model runs experts_implementation "moeblaze").
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"configure takes a transformers model or experts module (a torch.nn.Module), got "
                        f"{type(model).__name__}")
    config = from_legacy("configure", experts, legacy)
    if config.activation != DEFAULT.activation:
        raise ValueError(f"configure: activation={config.activation!r} would be ignored: each experts module's own "
                         "activation is read from the model (activation_of); leave the config's activation unset")
    n = 0
    for m in model.modules():
        if hasattr(m, "has_gate") and hasattr(m, "down_proj"):
            m.moeblaze_config = config
            n += 1
    if n == 0:
        raise ValueError(f"configure: {type(model).__name__} has no experts module of transformers' experts interface "
                         "(a module with gate_up_proj, down_proj and has_gate): nothing would run on moeblaze")
    impl = getattr(getattr(model, "config", None), "_experts_implementation", "moeblaze")
    if impl not in ("moeblaze", None):
        warnings.warn(f"configure: {type(model).__name__} runs experts_implementation={impl!r}; the recipe applies "
                      "once it runs 'moeblaze' (model.set_experts_implementation('moeblaze'))", UserWarning,
                      stacklevel=2)
    return n


@functools.cache
def _with_activation(config: ExpertsConfig, activation: str) -> ExpertsConfig:
    return config.replace(activation=activation)


def _gpt_oss_gate():
    """gpt-oss's clamped SwiGLU gate function (GptOssExperts._apply_gate), or None where transformers has none."""
    if "gpt_oss" not in _act_types:
        try:
            from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
            _act_types["gpt_oss"] = GptOssExperts._apply_gate
        except (ImportError, AttributeError):
            _act_types["gpt_oss"] = None
    return _act_types["gpt_oss"]


def activation_of(module) -> tuple[tuple[str, bool] | None, str | None]:
    """((moeblaze activation, interleaved), None) for a module moeblaze computes exactly, else (None, the reason
    it can't). Biases and transposed weights are read as they are; gpt-oss's gate function is the clamped SwiGLU
    over interleaved gate/up columns.

    Args:
        module: a transformers experts module.

    Returns:
        ((activation, interleaved), None) where moeblaze computes it, else (None, why not).
    """
    moe = _interface()
    if getattr(module, "has_post_expert_norm", False):
        return None, "a post-expert norm"
    gated = getattr(module, "has_gate", True)
    gate_fn = getattr(type(module), "_apply_gate", moe._default_apply_gate)
    if gated and gate_fn is not moe._default_apply_gate:
        if gate_fn is not _gpt_oss_gate():
            return None, "a custom _apply_gate"
        limit, alpha = getattr(module, "limit", None), getattr(module, "alpha", None)
        if (limit, alpha) != (CLAMP_LIMIT, CLAMP_ALPHA):
            return None, (f"a clamped SwiGLU with limit={limit}, alpha={alpha} "
                          f"(moeblaze's: {CLAMP_LIMIT}, {CLAMP_ALPHA})")
        return ("clamped_swiglu", True), None
    if not getattr(module, "is_concatenated", True):
        return None, "interleaved gate/up columns with the default gate (which splits them in halves)"
    hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
    table = GATED if gated else PLAIN
    act_fn = getattr(module, "act_fn", None)
    if hidden_act not in table or act_fn is None:
        return None, f"activation {hidden_act!r}"
    if hidden_act not in _act_types:
        from transformers.activations import ACT2FN

        _act_types[hidden_act] = type(ACT2FN[hidden_act])
    if type(act_fn) is not _act_types[hidden_act]:  # an act_fn replaced after construction
        return None, f"an act_fn of type {type(act_fn).__name__} (config says {hidden_act!r})"
    return (table[hidden_act], False), None


def _fallback(module, reason: str, *args):
    key = (type(module).__name__, reason)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"moeblaze experts backend: {type(module).__name__} has {reason}, which moeblaze's kernels "
                      "don't compute; it runs on transformers' grouped_mm instead", stacklevel=3)
    return _interface().ExpertsInterface._global_mapping["grouped_mm"](module, *args)


def _weights(module):
    """(w1 (E, F, D), w2 (E, D, H), b1 (E, F) or None, b2 (E, D) or None) of an experts module as views of its
    parameters (transposed views where the module stores them transposed)."""
    gated = module.has_gate
    w1, w2 = (module.gate_up_proj if gated else module.up_proj), module.down_proj
    if getattr(module, "is_transposed", False):
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    b1 = b2 = None
    if getattr(module, "has_bias", False):
        b1, b2 = (module.gate_up_proj_bias if gated else module.up_proj_bias), module.down_proj_bias
    return w1, w2, b1, b2


def experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts call on moeblaze (the implementation "moeblaze" registers), falling back to the eager
    experts, with a warning once per reason, for a module moeblaze can't compute (activation_of).

    Args:
        module: the experts module (its weights, biases, activation and moeblaze_config).
        hidden_states: (T, H) tokens.
        top_k_index: (T, K) expert ids; ids >= the module's experts are expert parallelism's sentinels (skipped).
        top_k_weights: (T, K) router weights.

    Returns:
        (T, H) in hidden_states' dtype: the weights applied and summed.
    """
    spec, reason = activation_of(module)
    if reason is not None:
        return _fallback(module, reason, hidden_states, top_k_index, top_k_weights)
    activation, interleaved = spec
    config = _with_activation(getattr(module, "moeblaze_config", DEFAULT), activation)
    # ids >= num_experts are expert parallelism's sentinels (skipped); a negative one is refused, as eager does
    fail_if((top_k_index < 0).any(), f"an expert id is negative: the ids must be in [0, {module.num_experts}), or "
            f">= {module.num_experts} for pairs another rank's experts take (skipped)")
    return routed_call(hidden_states, top_k_index, top_k_weights, *_weights(module), experts=config, sentinels=True,
                          interleaved=interleaved, out_dtype=hidden_states.dtype)


register()

__all__ = ["activation_of", "configure", "experts_forward", "register"]
