"""Which backend runs each launch of the experts op: the one place that decides, over the registry of kernel
backends (experts.backends).

    backend="tl"     the portable Triton kernels (experts.tl), on every GPU Triton supports and under the
                     CPU interpreter
    backend="gluon"  the Hopper warp-specialised kernels (experts.gluon_sm90) for every launch whose operands
                     they take (their takes_<stage> checks), tl for the others; asking for it off an sm_90 GPU
                     raises ValueError
    backend="auto"   "gluon" on sm_90 GPUs, "tl" elsewhere (the first registered backend that prefers the
                     device); MOEBLAZE_GLUON=0 (config) makes it "tl" everywhere

A launch the chosen backend can't take falls back to tl: a shape never raises. Every decision is counted in
`launch_counts` ((stage, backend) -> launches), so tests and benchmarks can see which kernels ran.
Memory: none (a counter of a few entries).
"""
from __future__ import annotations

import functools
from collections import Counter

import torch

from .. import env
from ..configs.experts import launch_backends
from . import backends

launch_counts: Counter = Counter()


def check_backend(backend: str) -> None:
    names = launch_backends()
    if backend not in names:
        raise ValueError(f"backend must be one of {names}, got {backend!r}")


def choose(backend: str, device: torch.device) -> str:
    """What a call with ExpertsConfig.backend `backend` runs on `device`: "reference" or a kernel backend's name
    (the launches' backend, each launch still falling back to tl where it can't take the operands). RuntimeError
    for the kernels off CUDA outside Triton's interpreter."""
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return "reference"
    if device.type != "cuda" and not env.INTERPRET:
        raise RuntimeError(f"backend={backend!r} runs the Triton kernels, which need a CUDA GPU (x is on {device}) "
                           "or Triton's CPU interpreter: set TRITON_INTERPRET=1 before importing moeblaze (or "
                           "triton); backend='auto' runs the PyTorch reference off CUDA")
    return resolve("auto" if backend == "triton" else backend, device)


@functools.lru_cache(maxsize=64)
def resolve(backend: str, device: torch.device) -> str:
    """The kernel backend of the launches of one call on `device` (see the module header); cached per (backend,
    device) until a backend is registered."""
    check_backend(backend)
    if backend == "auto":
        return backends.auto(device)
    b = backends.get(backend)
    if not b.available(device):
        raise ValueError(f"backend={backend!r} needs {b.needs}; the operands are on {device}. Use backend='tl' "
                         "or 'auto'.")
    return backend


backends.on_register(resolve.cache_clear)


def launch(stage: str, backend: str, device: torch.device, *args, **kwargs):
    """One launch of `stage` (experts.backends.STAGES) with the stage's arguments: on the backend a call resolved
    to where it takes them (its takes_<stage>, asked only then), on tl otherwise; counted."""
    b = backends.get(resolve(backend, device))
    if b.name != "tl" and not getattr(b, "takes_" + stage)(*args, **kwargs):
        b = backends.get("tl")
    launch_counts[stage, b.name] += 1
    return getattr(b, stage)(*args, **kwargs)
