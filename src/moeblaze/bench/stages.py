"""Per-stage time of the fused expert computation: every launch of one forward+backward step
(checkpoint="preact") timed alone, with its FLOPs, its rate and the autotuned config it ran with, and
the registers, spills and shared memory of every compiled kernel variant. The layer is compute-bound,
so a stage far below the GPU's GEMM rate is where a step loses its time.
Holds every intermediate of the step at once (H, dH, A, s·A, Y, dX~): size it for the GPU."""
from __future__ import annotations

import time

import torch

from ..kernels.experts import BLOCK_M, TUNED_KERNELS
from ..ops.experts import _combine, _down_bwd, _rows, _up, _weight_grad, tile_schedule
from ..reference import up_width
from ..routing import build_routing_index
from .harness import _median_ms, make_problem


def stage_times(L, d, h, E, K, activation="swiglu", dtype=torch.bfloat16, device="cuda", iters=10, seed=0):
    """[(stage, GPU ms, host µs per call, TFLOP/s or None, autotuned config of its kernel ("gluon_hopper" where
    the stage launched a Gluon kernel instead) or None,
    {config: ms} of every config the autotuner tried for this stage)] in the order a training step runs
    them."""
    p = make_problem(L, d, h, E, K, activation, dtype, device, n_sets=1, seed=seed)
    dev = torch.device(device)
    x, idx, w, dy = (t.detach() for t in p.sets[0])
    w1, w2 = p.w1.detach(), p.w2.detach()
    r = build_routing_index(idx, E)
    eti, offsets, slot = r.expert_token_idx, r.expert_offsets, r.token_slot
    LK, F = eti.shape[0], up_width(activation, h)
    sched = tile_schedule(r.expert_counts, offsets, LK, BLOCK_M)
    state = {}

    def up():
        state["preact"], state["act"] = _up(x, w1, eti, offsets, sched, activation, True, True)

    def down():
        state["y"] = _rows(state["act"], w2, (w2.stride(0), w2.stride(2), w2.stride(1)), d, offsets, sched)

    def combine():
        _combine(state["y"], slot, w.float(), x.dtype)

    def dh():
        state["dpreact"] = torch.empty_like(state["preact"])
        state["act_scaled"], _ = _down_bwd(dy, w2, state["preact"], w, slot, state["dpreact"], eti, offsets, sched,
                                           activation)

    def dw2():
        _weight_grad(dy, state["act_scaled"], tuple(w2.shape), eti, offsets, True, False, w2.dtype)

    def dw1():
        _weight_grad(state["dpreact"], x, tuple(w1.shape), eti, offsets, False, True, w1.dtype)

    def dx_rows():
        state["dx_rows"] = _rows(state["dpreact"], w1, (w1.stride(0), w1.stride(1), w1.stride(2)), d, offsets, sched)

    def dx():
        _combine(state["dx_rows"], slot, None, x.dtype)

    gemm = 2 * LK * d
    stages = [("up: x[idx] @ W1ᵀ, activation", up, gemm * F, "up"),
              ("down: A @ W2ᵀ", down, gemm * h, "rows"),
              ("combine", combine, None, None),
              ("dH: dy[idx] @ W2, activation backward", dh, gemm * h, "dH"),
              ("dW2: dy[idx]ᵀ @ s·A", dw2, gemm * h, "weight_grad"),
              ("dW1: dHᵀ @ x[idx]", dw1, gemm * F, "weight_grad"),
              ("dX~: dH @ W1", dx_rows, gemm * F, "rows"),
              ("dx: gather-sum", dx, None, None)]
    rows = []
    for name, fn, flops, kernel in stages:
        tuner = TUNED_KERNELS.get(kernel)
        if tuner is not None:  # tune this launch afresh so its trials are recorded, even if a step tuned it
            tuner.configs_timings = None
            tuner.cache.clear()
            tuner.best_config = None  # set again only if this stage launches the tuned kernel
        fn()  # compiles and autotunes; produces the next stage's inputs
        trials = {str(c): (t[0] if isinstance(t, (list, tuple)) else t)
                  for c, t in (getattr(tuner, "configs_timings", None) or {}).items()}
        ms = _median_ms(lambda i: fn(), dev, iters)
        # what its last launch used: a tl config, or kernels.gluon_hopper's kernel where the stage went there
        config = None if tuner is None else (str(tuner.best_config) if tuner.best_config else "gluon_hopper")
        rows.append((name, ms, _host_us(fn, dev), flops / ms / 1e9 if flops else None, config, trials))
    return rows


def _host_us(fn, dev: torch.device, n: int = 20) -> float:
    """Host time of one call (Python, argument handling, launches), without waiting for the GPU: a
    step whose summed host time nears its GPU time is launch-bound."""
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
