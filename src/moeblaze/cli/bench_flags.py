"""The flags of `moeblaze bench` and the checks that read only them, torch-free: `moeblaze bench` parses and refuses
a bad flag before torch loads (status 2, one line naming the flag). The device and the results folder are checked
next (cli/bench.py), before any work.

Memory: none beyond the parsed arguments.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..bench.names import CONFIGS, CPU_CONFIG, HF_BACKENDS, IMPLS
from ..configs import ACTIVATIONS, CHECKPOINTS
from . import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("one layer (the default): the configs and implementations timed")
    g.add_argument("--configs", default=None,
                   help="comma list of named configs (L,d,h,E,K): "
                        + "; ".join(f"{k} {','.join(map(str, v))}" for k, v in CONFIGS.items())
                        + ". Default all five on a GPU, unless --config, --scale or --dispatch is given; on the CPU "
                        + f"{CPU_CONFIG[0]} {','.join(map(str, CPU_CONFIG[1]))}, a shape the interpreter runs in "
                        "seconds")
    g.add_argument("--config", action="append", default=[], metavar="L,d,h,E,K", help="extra config (repeatable)")
    g.add_argument("--impls", default=None,
                   help=f"comma list from {','.join(IMPLS)} (default: all available but the moeblaze-<backend> ones, "
                        "which pin moeblaze to one backend)")
    g.add_argument("--policies", default=None,
                   help="moeblaze policies: preact, recompute, preact-fp8, and their token-chunked variants "
                        "preact-chunked, recompute-chunked, preact-fp8-chunked (default: preact,recompute; with "
                        "--scale also recompute-chunked)")
    g.add_argument("--precision", default="native", choices=("native", "fp8"),
                   help="fp8: add moeblaze-fp8 (precision=\"fp8\", policies preact and preact-fp8 unless --policies "
                        "names others) to the implementations, beside the peers' bf16")
    g.add_argument("--activation", default="swiglu", help="the experts' activation")
    g.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="default bfloat16 on cuda, float32 on cpu")
    g.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="where to run (default: cuda where a GPU is available, else cpu)")
    t = p.add_argument_group("timing")
    t.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (default 3; 0 on the CPU)")
    t.add_argument("--iters", type=int, default=None, help="timed calls per round (default 10; 1 on the CPU)")
    t.add_argument("--no-ref", action="store_true", help="skip the fp32 reference errors")
    t.add_argument("--stall-s", type=float, default=300,
                   help="print every thread's stack (to stderr) when one implementation's compile and checks "
                        "run longer than this, to show where it hangs; the run goes on (0: off)")
    t.add_argument("--gpu-busy", action="store_true",
                   help="also record gpu_busy_ms: the kernels' own time in one step (host overhead = step - busy)")
    s = p.add_argument_group("the token sweep (--scale)")
    s.add_argument("--scale", action="store_true", help="tokens from --min-tokens doubling until OOM or --max-tokens")
    s.add_argument("--scale-config", default="E", help="config whose d,h,E,K the scaling sweep uses")
    s.add_argument("--min-tokens", type=int, default=8192, help="--scale: the first token count")
    s.add_argument("--max-tokens", type=int, default=2 ** 21, help="--scale: the last token count")
    x = p.add_argument_group("the routing index builders (--dispatch)")
    x.add_argument("--dispatch", action="store_true", help="time the routing index builders")
    x.add_argument("--dispatch-L", default="32768,524288,2097152", help="--dispatch: token counts")
    x.add_argument("--dispatch-E", default="8,16,64,256", help="--dispatch: expert counts")
    x.add_argument("--dispatch-K", default="1,2,8", help="--dispatch: top-k values")
    h = p.add_argument_group("end to end in transformers models (--hf)")
    h.add_argument("--hf", default=None, metavar="MODELS",
                   help="end to end: train transformers models (comma list of qwen3-30b-a3b, olmoe-1b-7b, "
                        "mixtral-8x7b, gpt-oss-20b; published configs, random weights, fewer layers) with AdamW in "
                        "bf16 on each experts backend (--hf-backends); see moeblaze.bench.hf")
    h.add_argument("--hf-backends", default=",".join(HF_BACKENDS),
                   help="experts backends for --hf; also sonicmoe-adapter (SonicMoE's own API from its wheel, for "
                        "where transformers' sonicmoe backend can't fetch its kernels)")
    h.add_argument("--hf-layers", type=int, default=None, help="layers per model for --hf (default: bench.hf.LAYERS)")
    h.add_argument("--seq", type=int, default=4096, help="sequence length for --hf")
    h.add_argument("--batch", type=int, default=1, help="sequences per step for --hf")
    h.add_argument("--hf-steps", type=int, default=10, help="timed steps for --hf (after --warmup)")
    h.add_argument("--hf-profile", action="store_true",
                   help="for --hf: one more step per backend under torch.profiler (GPU busy time, top kernels)")
    h.add_argument("--max-batch", type=int, default=0, metavar="LIMIT",
                   help="for --hf: also find each backend's largest batch up to LIMIT sequences (0: skip)")
    o = p.add_argument_group("results")
    o.add_argument("--out", default="bench-results",
                   help="results folder (default bench-results, in the working directory)")


@dataclass(frozen=True)
class Scale:
    """--scale: the config's d, h, E, K at tokens doubling from `min_tokens` until out of memory or `max_tokens`."""
    shape: tuple[int, ...]
    min_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Dispatch:
    """--dispatch: the routing index builders at every (L, E, K) of these (K <= E)."""
    L: tuple[int, ...]
    E: tuple[int, ...]
    K: tuple[int, ...]


@dataclass(frozen=True)
class HF:
    """--hf: transformers models trained end to end on each experts backend (moeblaze.bench.hf)."""
    models: tuple[str, ...]
    backends: tuple[str, ...]
    layers: int | None
    seq: int
    batch: int
    steps: int
    profile: bool
    max_batch: int


@dataclass(frozen=True)
class BenchConfig:
    """One `moeblaze bench` run. `configs` None: the device's default (all five named ones on a GPU, a small one on
    the CPU); device, warmup and iters None: the machine's (cli/bench.py resolves them)."""
    configs: tuple[tuple[str, tuple[int, ...]], ...] | None
    impls: tuple[str, ...] | None
    policies: tuple[str, ...] | None
    precision: str
    activation: str
    dtype: str | None
    device: str | None
    warmup: int | None
    iters: int | None
    reference: bool  # the fp32 reference's errors (--no-ref: off)
    stall_s: float
    gpu_busy: bool
    scale: Scale | None
    dispatch: Dispatch | None
    hf: HF | None
    out: str

    def layer_configs(self) -> list[tuple[str, tuple[int, ...]]]:
        """The (name, (L, d, h, E, K)) the layer is timed at."""
        if self.configs is not None:
            return list(self.configs)
        return [CPU_CONFIG] if self.device == "cpu" else list(CONFIGS.items())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def bench_config(args) -> BenchConfig:
    """The flags as a BenchConfig (after check_flags's checks)."""
    given = args.scale or args.dispatch or args.config
    configs = None
    if args.configs is not None or given:
        configs = tuple((n, CONFIGS[n]) for n in (args.configs or "").split(",") if n)
        configs += tuple((c, _ints(c)) for c in args.config)
    return BenchConfig(
        configs=configs, impls=tuple(args.impls.split(",")) if args.impls else None,
        policies=tuple(args.policies.split(",")) if args.policies else None, precision=args.precision,
        activation=args.activation, dtype=args.dtype, device=args.device, warmup=args.warmup, iters=args.iters,
        reference=not args.no_ref, stall_s=args.stall_s, gpu_busy=args.gpu_busy,
        scale=Scale(CONFIGS.get(args.scale_config) or _ints(args.scale_config), args.min_tokens, args.max_tokens)
        if args.scale else None,
        dispatch=Dispatch(_ints(args.dispatch_L), _ints(args.dispatch_E), _ints(args.dispatch_K))
        if args.dispatch else None,
        hf=HF(tuple(args.hf.split(",")), tuple(args.hf_backends.split(",")), args.hf_layers, args.seq, args.batch,
              args.hf_steps, args.hf_profile, args.max_batch) if args.hf else None,
        out=args.out)


def check_flags(args) -> BenchConfig:
    """The run the flags say, after every check that reads only them (UsageError naming the flag): the configs, the
    implementations, the policies, the counts. Torch-free."""
    _check_shapes(args)
    _check_names(args)
    for flag in ("warmup", "iters", "min_tokens", "max_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < (0 if flag == "warmup" else 1):
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    for flag in ("dispatch_L", "dispatch_E", "dispatch_K"):
        if not all(v.isdigit() and int(v) > 0 for v in getattr(args, flag).split(",")):
            raise UsageError(f"--{flag.replace('_', '-')}: expected a comma list of positive integers, got "
                             f"{getattr(args, flag)!r}")
    return bench_config(args)


def _check_shapes(args) -> None:
    """--configs names known configs; --config and --scale-config are L,d,h,E,K."""
    for name in (args.configs or "").split(","):
        if name and name not in CONFIGS:
            raise UsageError(f"--configs: unknown config {name!r}; the named ones are {','.join(CONFIGS)} "
                             "(--config L,d,h,E,K gives any shape)")
    scale = [args.scale_config] if args.scale_config not in CONFIGS else []
    for c in args.config + scale:
        parts = c.split(",")
        sized = parts if c in args.config else parts[1:]  # --scale-config's L is unused: the sweep sets the tokens
        if (len(parts) != 5 or not all(v.isdigit() for v in parts) or not all(int(v) > 0 for v in sized)
                or int(parts[4]) > int(parts[3])):
            flag = "--config" if c in args.config else "--scale-config"
            raise UsageError(f"{flag}: expected L,d,h,E,K (positive integers, K <= E), got {c!r}")


def _check_names(args) -> None:
    """The activation, the policies and the implementations are ones moeblaze bench has."""
    if args.activation not in ACTIVATIONS:
        raise UsageError(f"--activation must be one of {','.join(ACTIVATIONS)}, got {args.activation!r}")
    policies = CHECKPOINTS + tuple(c + "-chunked" for c in CHECKPOINTS)
    for flag, names, known in (("--policies", args.policies, policies), ("--impls", args.impls, IMPLS)):
        for name in (names or "").split(","):
            if name and name not in known:
                kind = "policy" if flag == "--policies" else "implementation"
                raise UsageError(f"{flag}: unknown {kind} {name!r}; one of {','.join(known)}")
