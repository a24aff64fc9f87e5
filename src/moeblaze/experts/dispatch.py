"""Which backend runs each launch of the experts op: the one place that decides.

    backend="tl"     the portable Triton kernels (experts.tl), on every GPU Triton supports and under the
                     CPU interpreter
    backend="gluon"  the Hopper warp-specialised kernels (experts.gluon_sm90) for every launch whose operands
                     they take (bf16/fp16, contiguous, 16-byte aligned, the widths below), tl for the others;
                     asking for it off an sm_90 GPU raises ValueError
    backend="auto"   "gluon" on sm_90 GPUs, "tl" elsewhere; MOEBLAZE_GLUON=0 (config) makes it "tl" everywhere

A launch the Gluon kernels can't take falls back to tl: a shape never raises. Every decision is counted in
`launch_counts` ((stage, backend) -> launches), so tests and benchmarks can see which kernels ran.
Memory: none (a counter of a few entries).
"""
from __future__ import annotations

import functools
from collections import Counter

import torch

from .. import env
from ..configs import LAUNCH_BACKENDS
from .gluon_sm90 import GATHER_BLOCK_K, WGRAD_BLOCKS

launch_counts: Counter = Counter()


def check_backend(backend: str) -> None:
    if backend not in LAUNCH_BACKENDS:
        raise ValueError(f"backend must be one of {LAUNCH_BACKENDS}, got {backend!r}")


def choose(backend: str, device: torch.device) -> str:
    """What a call with ExpertsConfig.backend `backend` runs on `device`: "reference", "tl" or "gluon" (the
    launches' backend, each launch still falling back to tl where Gluon can't take its operands). RuntimeError
    for the kernels off CUDA outside Triton's interpreter."""
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return "reference"
    if device.type != "cuda" and not env.INTERPRET:
        raise RuntimeError(f"backend={backend!r} runs the Triton kernels, which need a CUDA GPU (x is on {device}) "
                           "or Triton's CPU interpreter: set TRITON_INTERPRET=1 before importing moeblaze (or "
                           "triton); backend='auto' runs the PyTorch reference off CUDA")
    return resolve("auto" if backend == "triton" else backend, device)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def gluon_device(device: torch.device) -> bool:
    """Whether the Gluon kernels can run on this device: an sm_90 (Hopper) GPU, outside the interpreter."""
    if device.type != "cuda" or env.INTERPRET:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] == 9


def resolve(backend: str, device: torch.device) -> str:
    """"tl" or "gluon" for the launches of one call on `device` (see the module header)."""
    check_backend(backend)
    if backend == "gluon":
        if not gluon_device(device):
            raise ValueError(f"backend='gluon' needs an sm_90 (Hopper) GPU outside the Triton interpreter; the "
                             f"operands are on {device}. Use backend='tl' or 'auto'.")
        return "gluon"
    if backend == "auto":
        return "gluon" if env.GLUON_BY_DEFAULT and gluon_device(device) else "tl"
    return "tl"


def _takes(*tensors: torch.Tensor | None, dtypes=(torch.bfloat16, torch.float16)) -> bool:
    """Operands a Gluon kernel can read: bf16/fp16 (or dtypes), contiguous, 16-byte aligned (TMA and cp.async);
    None, an optional part that is absent, passes."""
    return all(t is None or (t.dtype in dtypes and t.is_contiguous() and t.data_ptr() % 16 == 0) for t in tensors)


def _pick(stage: str, backend: str, device: torch.device, gluon_takes) -> str:
    """The backend of one launch of `stage`: Gluon where it was asked for (resolved) and it takes the operands
    (gluon_takes, called only then), tl otherwise; counted."""
    choice = "gluon" if resolve(backend, device) == "gluon" and gluon_takes() else "tl"
    launch_counts[stage, choice] += 1
    return choice


def up(backend: str, x_LD, w1_EFD, activation: str, plain_layout: bool = True, w1_up=None) -> str:
    """The up-projection: Gluon for SwiGLU without a bias and with the gate rows first (plain_layout), D a
    multiple of a gathered stage's K; W1 whole or in two parts (w1_up: the up rows), each read in place."""
    return _pick("up", backend, x_LD.device, lambda: activation == "swiglu" and plain_layout
                 and x_LD.shape[1] % GATHER_BLOCK_K == 0 and _takes(x_LD, w1_EFD, w1_up))


def rows(stage: str, backend: str, a, w, w_up=None) -> str:
    """A row GEMM (stage "down" or "dx_rows"): Gluon where K and N are multiples of 8 (16-byte TMA rows); W1 in two
    parts (w_up, dx_rows) where the gate part's rows are a multiple of a stage's K (64, GATHER_BLOCK_K: no box
    straddles the two)."""
    return _pick(stage, backend, a.device, lambda: a.shape[1] % 8 == 0 and w.shape[1] % 8 == 0
                 and w.shape[2] % 8 == 0 and (w_up is None or w.shape[1] % GATHER_BLOCK_K == 0) and _takes(a, w, w_up))


def down_bwd(backend: str, dy_LD, w2_EDH, preact) -> str:
    """dA' (then the activation's backward as a pass of its own on Gluon): D a multiple of a gathered stage's
    K, H of 8."""
    return _pick("down_bwd", backend, dy_LD.device, lambda: dy_LD.shape[1] % GATHER_BLOCK_K == 0
                 and w2_EDH.shape[2] % 8 == 0 and preact.is_contiguous() and _takes(dy_LD, w2_EDH))


def weight_grad(backend: str, p, q, out, gather_p: bool, out_up=None) -> str:
    """A weight gradient: Gluon where dW (out, contiguous) is in the operands' dtype or float32, the gathered
    side's width is a multiple of its block (WGRAD_BLOCKS) and the dense side's and dW's columns multiples of 8; dW
    in two parts (out_up: dW1's up rows) where the first part's rows are a multiple of a tile's (every tile in one
    part)."""
    gathered, dense = (p, q) if gather_p else (q, p)
    return _pick("weight_grad", backend, p.device, lambda: p.dtype == q.dtype
                 and (out_up is None or out_up.dtype == out.dtype)
                 and gathered.shape[1] % WGRAD_BLOCKS[0 if gather_p else 1] == 0 and dense.shape[1] % 8 == 0
                 and out.shape[2] % 8 == 0 and (out_up is None or out.shape[1] % WGRAD_BLOCKS[0] == 0)
                 and _takes(p, q) and _takes(out, out_up, dtypes=(p.dtype, torch.float32)))


def fp8_rows(backend: str, a_q, w_q, out_dtype) -> str:
    """An fp8 row GEMM (precision="fp8"): Gluon where A and W are e4m3, K a multiple of 128 (A's rows are read by
    the gathering loader, in place too: whole 16-byte copies of whole scale groups), N of 8 and C in
    bf16/fp16/fp32."""
    K = w_q.shape[2]
    return _pick("fp8_rows", backend, a_q.device, lambda: K % 128 == 0 and w_q.shape[1] % 8 == 0
                 and out_dtype in (torch.bfloat16, torch.float16, torch.float32)
                 and _takes(a_q, w_q, dtypes=(torch.float8_e4m3fn,)))


