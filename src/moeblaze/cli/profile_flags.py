"""The flags of `moeblaze profile` and the checks that read only them, torch-free: `moeblaze profile` parses and
refuses a bad flag before torch loads (status 2, one line naming the flag); the device is checked next
(cli/profile.py), before any work.

Memory: none beyond the parsed arguments.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..configs import ACTIVATIONS, BACKENDS, CHECKPOINTS, PRECISIONS, ExpertsConfig, check_layer
from . import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="layer", choices=("layer", "model"),
                   help="one MoE layer, or the small model (train's shape flags)")
    p.add_argument("--tokens", type=int, default=None, help="tokens (layer) or batch*seq (model); default 4096 "
                   "on cuda, 256 on cpu")
    p.add_argument("--d-model", type=int, default=None, help="hidden size (default 1024 on cuda, 64 on cpu)")
    p.add_argument("--d-expert", type=int, default=None, help="expert width (default 2048 on cuda, 128 on cpu)")
    p.add_argument("--num-experts", type=int, default=8, help="experts")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--activation", default="swiglu", choices=ACTIVATIONS, help="the experts' activation")
    p.add_argument("--checkpoint-policy", default="preact", choices=CHECKPOINTS,
                   help="what the experts keep for backward")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="where to run (default: cuda where a GPU is available, else cpu)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--no-compare", action="store_true", help="skip the conventional pipeline")
    p.add_argument("--kernels", action="store_true", help="also list GPU time per kernel (torch.profiler)")
    p.add_argument("--precision", default="native", choices=PRECISIONS,
                   help="fp8: the experts' data GEMMs on e4m3 (the kernel table then shows the fp8 step)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="auto: the kernels (Gluon on Hopper, tl elsewhere; on the CPU under Triton's interpreter); "
                        "reference: the PyTorch reference; triton, tl or gluon: those kernels")
    p.add_argument("--impl", default=None, choices=("auto", "triton", "reference"),
                   help="deprecated: --backend (impl triton is --backend triton, reference --backend reference)")


@dataclass(frozen=True)
class ProfileConfig:
    """One `moeblaze profile` run: a layer of `tokens` tokens (or the small model on batch x seq = tokens) with the
    experts' recipe `experts`. tokens, d_model, d_expert, device and dtype None: the machine's (cli/profile.py)."""
    target: str
    tokens: int | None
    d_model: int | None
    d_expert: int | None
    num_experts: int
    top_k: int
    experts: ExpertsConfig
    device: str | None
    dtype: str | None
    compare: bool  # the conventional pipeline beside it (--no-compare: off)
    kernels: bool


def backend_of(args) -> str:
    """ExpertsConfig.backend of --backend (and the deprecated --impl folded into it)."""
    from .train_flags import backend_flag

    return backend_flag(args)


def check_flags(args) -> ProfileConfig:
    """The run the flags say, after every check that reads only them (UsageError naming the flag): well formed, and
    the experts' recipe one ExpertsConfig takes. Torch-free."""
    for flag in ("tokens", "d_model", "d_expert", "num_experts", "top_k"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive integer, got {v}")
    try:
        check_layer(args.num_experts, args.top_k)
        experts = ExpertsConfig(activation=args.activation, checkpoint=args.checkpoint_policy,
                                backend=backend_of(args), precision=args.precision)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    return ProfileConfig(args.target, args.tokens, args.d_model, args.d_expert, args.num_experts, args.top_k,
                         experts, args.device, args.dtype, not args.no_compare, args.kernels)
