"""Per-stage time of the fused expert computation: every launch of one forward+backward step
(checkpoint="preact") timed alone, with its FLOPs, its rate and the autotuned config it ran with, and
the registers, spills and shared memory of every compiled kernel variant. The layer is compute-bound,
so a stage far below the GPU's GEMM rate is where a step loses its time.
Holds every intermediate of the step at once (H, dH, A, s·A, Y, dX~): size it for the GPU."""
from __future__ import annotations

import time

import torch

from ..experts import stages
from ..experts.stages import RowPlan
from ..experts.tl import TUNED_KERNELS
from ..reference import up_width
from ..routing import build_routing_index
from .harness import _median_ms, make_problem


def stage_times(L, d, h, E, K, activation="swiglu", *, dtype=torch.bfloat16, device="cuda", iters=10, seed=0,
                backend="auto"):
    """[(stage, GPU ms, host µs per call, TFLOP/s or None, autotuned tl config of its kernel ("gluon" where the
    stage launched a Gluon kernel instead) or None, {config: ms} of every config the autotuner tried for this
    stage)] in the order a training step runs them, through experts.stages on `backend`."""
    p = make_problem(L, d, h, E, K, activation, dtype=dtype, device=device, n_sets=1, seed=seed)
    dev = torch.device(device)
    x, idx, w, dy = (t.detach() for t in p.sets[0])
    w1, w2 = p.w1.detach(), p.w2.detach()
    plan = RowPlan.build(build_routing_index(idx, E))
    R, F = plan.num_rows, up_width(activation, h)
    state = {}

    def up():
        state["preact"], state["act"] = stages.up(plan, x, w1, activation, backend=backend)

    def down():
        state["y"] = stages.down(plan, state["act"], w2, backend=backend)

    def combine():
        stages.combine(plan, state["y"], w.float(), x.dtype)

    def down_bwd():
        state["dpreact"] = torch.empty_like(state["preact"])
        state["act_scaled"], _ = stages.down_bwd(plan, dy, w2, state["preact"], w, state["dpreact"], activation,
                                                 backend=backend)

    def dw2():
        stages.weight_grad(plan, dy, state["act_scaled"], torch.empty_like(w2), True, backend=backend)

    def dw1():
        stages.weight_grad(plan, state["dpreact"], x, torch.empty_like(w1), False, backend=backend)

    def dx_rows():
        state["dx_rows"] = stages.dx_rows(plan, state["dpreact"], w1, backend=backend)

    def dx():
        stages.combine(plan, state["dx_rows"], None, x.dtype)

    gemm = 2 * R * d
    steps = [("up: x[idx] @ W1ᵀ, activation", up, gemm * F, "up"),
             ("down: A @ W2ᵀ", down, gemm * h, "rows"),
             ("combine", combine, None, None),
             ("down_bwd: dy[idx] @ W2, dH", down_bwd, gemm * h, "down_bwd"),
             ("dW2: dy[idx]ᵀ @ s·A", dw2, gemm * h, "weight_grad"),
             ("dW1: dHᵀ @ x[idx]", dw1, gemm * F, "weight_grad"),
             ("dX~: dH @ W1", dx_rows, gemm * F, "rows"),
             ("dx: gather-sum", dx, None, None)]
    rows = []
    for name, fn, flops, kernel in steps:
        tuner = TUNED_KERNELS.get(kernel)
        if tuner is not None:  # tune this launch afresh so its trials are recorded, even if a step tuned it
            tuner.configs_timings = None
            tuner.cache.clear()
            tuner.best_config = None  # set again only if this stage launches the tuned kernel
        fn()  # compiles and autotunes; produces the next stage's inputs
        trials = {str(c): (t[0] if isinstance(t, (list, tuple)) else t)
                  for c, t in (getattr(tuner, "configs_timings", None) or {}).items()}
        ms = _median_ms(lambda i, fn=fn: fn(), dev, iters)
        # what its last launch used: a tl config, or a Gluon kernel where the stage went there
        config = None if tuner is None else (str(tuner.best_config) if tuner.best_config else "gluon")
        host_us = _host_us(fn, dev, 20 if dev.type == "cuda" else iters)
        rows.append((name, ms, host_us, flops / ms / 1e9 if flops else None, config, trials))
    return rows


def _host_us(fn, dev: torch.device, n: int) -> float:
    """Host time of one call over n calls (Python, argument handling, launches), without waiting for the GPU: a
    step whose summed host time nears its GPU time is launch-bound. (On the CPU the host time is the run time:
    --iters calls measure it.)"""
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return us


def compiled_resources() -> list[tuple]:
    """[(kernel, tile constants, warps, stages, registers, spills, shared bytes)] of every variant
    compiled in this process (the autotuner's trials included): what limits occupancy."""
    rows = []
    for name, k in TUNED_KERNELS.items():
        tuned = {"BLOCK_M"}.union(*(c.kwargs for c in k.configs))  # the constants configs choose
        for cache in getattr(k.fn, "device_caches", {}).values():
            for ck in cache[0].values():
                try:
                    ck._init_handles()
                    names = ck.src.fn.arg_names
                    consts = {names[key[0] if isinstance(key, tuple) else key]: v
                              for key, v in ck.src.constants.items()
                              if isinstance(key, (tuple, int))}
                    tile = {n: v for n, v in consts.items() if n in tuned}
                    rows.append((name, tile, ck.metadata.num_warps, ck.metadata.num_stages, ck.n_regs, ck.n_spills,
                                 ck.metadata.shared))
                except Exception as e:  # a Triton version without these fields: report, don't fail
                    rows.append((name, {"unavailable": type(e).__name__}, 0, 0, 0, 0, 0))
    return rows
