"""ExpertsConfig, the experts' recipe: every surface that runs experts takes one: moe_experts, moe_experts_reference,
MoELayer / Experts, ModelConfig, the transformers backend's configure, expert parallelism and the command line (one
function maps its flags to it). A combination it accepts runs everywhere it is accepted; one it refuses is refused
here, by name.

    activation        swiglu (default), geglu, clamped_swiglu (gpt-oss), silu, gelu, relu, relu2
    checkpoint        what the forward keeps for backward: "preact" (the pre-activation H, R·F elements), "preact-fp8"
                      (H in e4m3 with 1 x 128 scales, about half of preact's bytes), "recompute" (nothing beyond the
                      routing index: H is recomputed, one more GEMM)
    backend           which code runs: "auto" (the kernels on CUDA, the PyTorch reference elsewhere), "reference",
                      "triton" (the kernels, each launch on the best backend the device has: Gluon on Hopper, tl
                      elsewhere and under Triton's CPU interpreter), "tl" or "gluon" (pinned; experts.dispatch)
    precision         "native" (the GEMMs in the inputs' dtype) or "fp8" (the four data GEMMs on e4m3 operands with
                      DeepSeek-V3's 1 x 128 / 128 x 128 scales; experts.fp8), where e4m3 pays: see fp8_min_rows
    fp8_min_rows      (fp8) the fewest rows per expert (L·K/E of a call, or of a chunk) at which the GEMMs run on
                      e4m3; a call below it runs precision="native" (at_call). The weights are quantized per call,
                      a cost of E·F·D that the e4m3 GEMMs repay only over enough rows: on an H100, e4m3 against
                      bf16 was 0.68-1.01x at 512-1536 rows per expert (1.09x at one shape of 1536) and 1.10-1.14x
                      at 2048 and more (docs/notes/). 0: e4m3 at every size
    fp8_weight_cache  (fp8) each weight's e4m3 copies kept until the weight changes, instead of made where used
    chunk_tokens      run the experts on chunks of this many tokens, each with its own routing index, so that every
                      (L·K, ·) transient scales with the chunk (None: one chunk)
    index_method      how a routing index is built from top-k ids: "auto", "dense" (MoEBlaze's sort-free build)
                      or "sort"

Memory: none (frozen dataclasses of a few fields).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass

from ..args import check_bool, check_choice, check_int

GATED = ("swiglu", "geglu", "clamped_swiglu")  # act(gate) · up over [gate | up] (reference.activations)
PLAIN = ("silu", "gelu", "relu", "relu2")
ACTIVATIONS = GATED + PLAIN
CHECKPOINTS = ("preact", "recompute", "preact-fp8")
LAUNCH_BACKENDS = ("auto", "tl", "gluon")  # what one kernel launch runs on (experts.dispatch resolves "auto")
BACKENDS = ("auto", "reference", "triton", *LAUNCH_BACKENDS[1:])  # ExpertsConfig.backend (experts.dispatch.choose)
PRECISIONS = ("native", "fp8")
INDEX_METHODS = ("auto", "dense", "sort")
FP8_MIN_ROWS = 2048  # ExpertsConfig.fp8_min_rows's default (docs/performance.md has the crossover it comes from)
_REGISTERED: list[str] = []  # kernel backends registered beyond the built-in ones (experts.backends.register)


def add_launch_backend(name: str) -> None:
    """Make a registered kernel backend's name a choice of ExpertsConfig.backend (experts.backends.register)."""
    if name not in LAUNCH_BACKENDS and name not in _REGISTERED:
        _REGISTERED.append(name)


def launch_backends() -> tuple[str, ...]:
    """What one kernel launch may run on: "auto" and every registered kernel backend."""
    return (*LAUNCH_BACKENDS, *_REGISTERED)


def backends() -> tuple[str, ...]:
    """ExpertsConfig.backend's choices: BACKENDS and every kernel backend registered beyond them."""
    return (*BACKENDS, *_REGISTERED)


@dataclass(frozen=True)
class ExpertsConfig:
    """The experts' recipe (see the module header). Frozen: derive another with `.replace(**changes)`.

    Args:
        activation: "swiglu" (default), "geglu", "clamped_swiglu", "silu", "gelu", "relu" or "relu2".
        checkpoint: what forward keeps for backward: "preact" (default), "preact-fp8" or "recompute".
        backend: "auto" (default), "reference", "triton", "tl" or "gluon".
        precision: "native" (default) or "fp8".
        fp8_weight_cache: with precision="fp8", keep each weight's e4m3 copies until the weight changes.
        fp8_min_rows: with precision="fp8", the fewest rows per expert that run on e4m3 (default 2048; 0: always).
        chunk_tokens: run the experts on chunks of this many tokens (None: one chunk).
        index_method: the routing index's build: "auto" (default), "dense" or "sort".

    Returns:
        A frozen value; ValueError or TypeError naming the field for a choice it refuses.
    """
    activation: str = "swiglu"
    checkpoint: str = "preact"
    backend: str = "auto"
    precision: str = "native"
    fp8_weight_cache: bool = False
    fp8_min_rows: int = FP8_MIN_ROWS
    chunk_tokens: int | None = None
    index_method: str = "auto"

    def __post_init__(self):
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("checkpoint", self.checkpoint, CHECKPOINTS)
        check_choice("backend", self.backend, backends())
        check_choice("precision", self.precision, PRECISIONS)
        check_bool("fp8_weight_cache", self.fp8_weight_cache)
        if self.fp8_weight_cache and self.precision != "fp8":
            raise ValueError(f"fp8_weight_cache=True needs precision='fp8'; precision is {self.precision!r}")
        check_int("fp8_min_rows", self.fp8_min_rows, minimum=0)
        if self.fp8_min_rows != FP8_MIN_ROWS and self.precision != "fp8":
            raise ValueError(f"fp8_min_rows={self.fp8_min_rows} applies to precision='fp8', which would read it; "
                             f"precision is {self.precision!r}")
        if self.chunk_tokens is not None:
            check_int("chunk_tokens", self.chunk_tokens)
        check_choice("index_method", self.index_method, INDEX_METHODS)

    def replace(self, **changes) -> ExpertsConfig:
        return dataclasses.replace(self, **changes)

    def native(self) -> ExpertsConfig:
        """This recipe in native precision (the fp8 fields back at their defaults)."""
        return _native(self)

    @property
    def fp8(self) -> bool:
        return self.precision == "fp8"

    def rows_per_call(self, tokens: int, top_k: int) -> int:
        """The (token, expert) rows of one call of `tokens` tokens (of one chunk, with chunk_tokens): the experts
        average this / E, what fp8_min_rows is held to."""
        return min(tokens, self.chunk_tokens or tokens) * top_k

    def at_call(self, tokens: int, top_k: int, experts: int) -> ExpertsConfig:
        """The recipe a call of `tokens` tokens, each to `top_k` of `experts` experts, runs (the one place the rule
        of fp8_min_rows is applied): precision="fp8" turns "native" where the experts average fewer than
        fp8_min_rows rows per call (per chunk, with chunk_tokens), the weight cache with it; else itself."""
        if not self.fp8 or self.rows_per_call(tokens, top_k) >= self.fp8_min_rows * experts:
            return self
        return _native(self)

    @property
    def kernels(self) -> bool:
        """Whether the kernels run wherever they can (every backend but "reference"; "auto" off CUDA is the
        reference too: see resolve)."""
        return self.backend != "reference"


DEFAULT = ExpertsConfig()  # every surface's default recipe: passing it is the same as passing none


@functools.cache
def _native(config: ExpertsConfig) -> ExpertsConfig:
    """config in native precision (made once per config: at_call runs on every call)."""
    return config.replace(precision="native", fp8_weight_cache=False, fp8_min_rows=FP8_MIN_ROWS)

# The keyword arguments of 0.1's call forms, and the ExpertsConfig field each maps to (impl folds into backend).
LEGACY = ("activation", "checkpoint", "impl", "backend", "precision", "fp8_weight_cache", "fp8_wgrad",
          "chunk_tokens", "index_method")


def fold_impl(impl: str, backend: str) -> str:
    """0.1's two axes (impl: auto, triton, reference; backend: auto, tl, gluon) as ExpertsConfig's one backend."""
    check_choice("impl", impl, ("auto", "triton", "reference"))
    check_choice("backend", backend, launch_backends() if impl != "auto" else backends())
    if impl == "reference":
        if backend != "auto":
            raise ValueError(f"impl='reference' runs no kernel: backend={backend!r} would not be read")
        return "reference"
    return "triton" if (impl, backend) == ("triton", "auto") else backend


def _renamed(where: str, experts: ExpertsConfig | None, old: ExpertsConfig | None, legacy: dict, stacklevel: int):
    """`experts`, or `old` given as config= (0.2's name) with a DeprecationWarning; TypeError for both forms."""
    if old is None:
        return experts
    if experts is not None or legacy:
        raise TypeError(f"{where}(): pass the recipe as experts= only, not also as config= (its 0.2 name)")
    warnings.warn(f"{where}(config=...) is deprecated and goes in 0.3: pass experts=", DeprecationWarning,
                  stacklevel=stacklevel + 1)
    return old


def from_legacy(where: str, experts: ExpertsConfig | None, legacy: dict, stacklevel: int = 3) -> ExpertsConfig:
    """The recipe of a call: `experts` (None or DEFAULT: unset); 0.2's name for it, config=, or 0.1's form (its
    options as keyword arguments), each with a DeprecationWarning that names the new form. TypeError for a recipe of
    another type, an unknown keyword or two forms at once. stacklevel: the warning's, as warnings.warn counts it
    from here (3: the caller of the public function that called this)."""
    legacy = {k: v for k, v in legacy.items() if v is not None}  # None: unset, as 0.1's had it
    experts = _renamed(where, None if experts is DEFAULT else experts, legacy.pop("config", None), legacy, stacklevel)
    if experts is not None and not isinstance(experts, ExpertsConfig):
        raise TypeError(f"experts must be a moeblaze.ExpertsConfig, got {type(experts).__name__}")
    if not legacy:
        return experts if experts is not None else DEFAULT
    unknown = sorted(set(legacy) - set(LEGACY))
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s) {unknown}")
    if experts is not None:
        raise TypeError(f"{where}(): pass the options in experts=ExpertsConfig(...) only, not also as "
                        f"{sorted(legacy)}")
    fields = dict(legacy)
    if fields.pop("fp8_wgrad", False):
        raise ValueError("fp8_wgrad was removed in 0.2: the e4m3 weight gradients made the step slower in every "
                         "measured configuration; the weight gradients run in the inputs' dtype")
    fields["backend"] = fold_impl(fields.pop("impl", "auto"), fields.pop("backend", "auto"))
    new = ExpertsConfig(**fields)
    shown = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(new).items()
                      if v != getattr(ExpertsConfig, k))
    warnings.warn(f"{where}({', '.join(sorted(legacy))}=...) is deprecated and goes in 0.3: pass "
                  f"experts=moeblaze.ExpertsConfig({shown})", DeprecationWarning, stacklevel=stacklevel)
    return new
