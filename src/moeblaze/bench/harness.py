"""The side-by-side MoE layer benchmark: every implementation gets the same routing (int32 top-k ids,
fp32 weights that need gradients), the same weights in its own layout (a free view of ours), and the
same rotated inputs; timings are CUDA-event medians after warm-up, memory comes from the allocator
(GPU) or from the tensors autograd saved (CPU)."""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable

import torch

from .. import env
from ..experts import moe_experts
from ..configs import DEFAULT, ExpertsConfig
from ..reference import moe_experts_reference, up_width
from ..routing import build_routing_index, route_topk
from ..routing.index import build_index_sort, count_per_expert
from .baselines import torch_gmm_experts
from .memory import SavedTensorCounter
from .timeline import _union, trace_kernels

MB = 2 ** 20


@dataclasses.dataclass
class Problem:
    L: int
    d: int
    h: int
    E: int
    K: int
    activation: str
    dtype: torch.dtype
    device: torch.device
    w1: torch.Tensor  # (E, F, d) leaves in moeblaze's layout
    w2: torch.Tensor  # (E, d, h)
    sets: list  # [(x, topk_idx, topk_w, dy)], rotated between iterations

    @property
    def flops(self) -> float:
        """Forward + backward FLOPs: 18·L·K·d·h gated (6 forward, 12 backward), 12·L·K·d·h plain."""
        return (18 if up_width(self.activation, 1) == 2 else 12) * self.L * self.K * self.d * self.h


def make_problem(L, d, h, E, K, activation="swiglu", *, dtype=torch.bfloat16, device="cuda", n_sets=2, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = torch.device(device)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

    w1 = randn(E, up_width(activation, h), d, scale=d ** -0.5).requires_grad_()
    w2 = randn(E, d, h, scale=h ** -0.5).requires_grad_()
    sets = []
    for _ in range(n_sets):
        idx, w = route_topk(torch.randn(L, E, generator=g).to(dev), K)  # near-balanced, like a fresh router
        sets.append((randn(L, d).requires_grad_(), idx, w.requires_grad_(), randn(L, d)))
    return Problem(L, d, h, E, K, activation, dtype, dev, w1, w2, sets)


# ---- implementations: name -> (policies, builder(problem, policy) -> call(x, idx, w, w1, w2) -> out) ----

CHUNK_TOKENS = 262144  # the "-chunked" policies: token chunks for millions of tokens


def moeblaze_call(p: Problem, policy: str, backend: str = "auto", precision: str = "native",
                  weight_cache: bool = False, fp8_min_rows: int = DEFAULT.fp8_min_rows):
    """weight_cache: precision="fp8" with fp8_weight_cache, each step taken as an optimizer step's only micro-batch
    (the weights' version counters moved on before it, as an update would), so it pays one quantization a step.
    fp8_min_rows: ExpertsConfig's (0: e4m3 at every size)."""
    checkpoint = policy.removesuffix("-chunked")
    chunk = CHUNK_TOKENS if policy.endswith("-chunked") else None

    def call(x, idx, w, w1, w2):
        if weight_cache:
            torch.autograd.graph.increment_version(w1)
            torch.autograd.graph.increment_version(w2)
        r = build_routing_index(idx, p.E, check=False)
        return moe_experts(x, r, w, w1, w2, experts=config, check=False)
    config = ExpertsConfig(activation=p.activation, checkpoint=checkpoint, backend="triton" if backend == "auto"
                           else backend, precision=precision, fp8_weight_cache=weight_cache,
                           fp8_min_rows=fp8_min_rows, chunk_tokens=chunk)
    return call


def _moeblaze_backend(backend: str):
    return lambda p, policy: moeblaze_call(p, policy, backend)


def _reference(p: Problem, policy: str):
    return lambda x, idx, w, w1, w2: moe_experts_reference(x, idx, w, w1, w2,
                                                                                experts=ExpertsConfig(p.activation))


def _torch_gmm(p: Problem, policy: str):
    return lambda x, idx, w, w1, w2: torch_gmm_experts(x, idx, w, w1, w2, p.activation)


def _sonicmoe(p: Problem, policy: str):
    import sonicmoe
    from sonicmoe.enums import ActivationType

    if p.activation != "swiglu":
        raise NotImplementedError("benchmarked with SwiGLU only (concatenated gate/up layout)")

    def call(x, idx, w, w1, w2):
        tokens = torch.arange(p.L, device=x.device, dtype=torch.int32).repeat_interleave(p.K)
        out, _ = sonicmoe.moe_general_routing_inputs(
            x, w.reshape(-1), tokens, idx.reshape(-1), w1.permute(1, 2, 0), None, w2.permute(1, 2, 0), None, p.E,
            torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU, False, True)
        return out
    return call


def _liger(p: Problem, policy: str):
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    if p.activation != "swiglu":
        raise NotImplementedError("Liger's fused MoE is SwiGLU only")
    return lambda x, idx, w, w1, w2: LigerFusedMoEFunction.apply(x, w1, w2, idx, w)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


IMPLS: dict[str, tuple[Callable[[], bool], tuple, Callable]] = {
    "moeblaze": (lambda: torch.cuda.is_available() or env.INTERPRET,
                 ("preact", "recompute"), moeblaze_call),
    # moeblaze on one backend (experts.dispatch): "tl" runs everywhere, "gluon" on Hopper
    "moeblaze-tl": (lambda: torch.cuda.is_available() or env.INTERPRET, ("preact", "recompute"),
                    _moeblaze_backend("tl")),
    "moeblaze-gluon": (lambda: torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9,
                       ("preact", "recompute"), _moeblaze_backend("gluon")),
    # moeblaze with precision="fp8" as a user gets it (experts.fp8): e4m3 data GEMMs where the experts get
    # fp8_min_rows rows each, native ones below; on GPUs with fp8 tensor cores
    "moeblaze-fp8": (lambda: env.INTERPRET or (torch.cuda.is_available()
                                                   and torch.cuda.get_device_capability() >= (8, 9)),
                     ("preact", "preact-fp8"), lambda p, policy: moeblaze_call(p, policy, precision="fp8")),
    # the e4m3 GEMMs at every size (fp8_min_rows=0), and the same with fp8_weight_cache (the weights quantized once
    # a step, both layouts)
    "moeblaze-e4m3": (lambda: IMPLS["moeblaze-fp8"][0](), ("preact", "preact-fp8"),
                      lambda p, policy: moeblaze_call(p, policy, precision="fp8", fp8_min_rows=0)),
    "moeblaze-e4m3-cached": (lambda: IMPLS["moeblaze-fp8"][0](), ("preact", "preact-fp8"),
                             lambda p, policy: moeblaze_call(p, policy, precision="fp8", weight_cache=True,
                                                             fp8_min_rows=0)),
    "reference": (lambda: True, ("-",), _reference),
    "torch_gmm": (lambda: hasattr(torch, "_grouped_mm"), ("-",), _torch_gmm),
    "sonicmoe": (lambda: torch.cuda.is_available() and _importable("sonicmoe"), ("-",), _sonicmoe),
    "liger": (lambda: torch.cuda.is_available() and _importable("liger_kernel"),
              ("autotune" if os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "1") != "0" else "pinned",), _liger),
}


def available_impls(names=None) -> list[str]:
    """The named impls that can run here; by default every one but the moeblaze-<backend> ones."""
    return [n for n in (names or [n for n in IMPLS if not n.startswith("moeblaze-")]) if IMPLS[n][0]()]


# ---- measurement --------------------------------------------------------------------------------

class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.ms_cpu = (time.perf_counter() - self.t0) * 1e3

    @property
    def ms(self) -> float:
        return self.start.elapsed_time(self.end) if self.cuda else self.ms_cpu


MEASURE_S = 1.0  # seconds a GPU timing lasts at least


def timed_rounds(fns: dict, device: torch.device, iters: int, min_s: float | None = None) -> dict:
    """{name: (median ms of fn(i), median host ms to issue it), or the exception that stopped it}: CUDA
    events on GPUs, the host clock on the CPU; the host ms is the host clock around the call alone (no
    synchronization), so where it is close to the first, the host, not the GPU, sets the pace. The fns
    take turns, `iters` calls each per round, and on GPUs rounds repeat until every fn has had min_s
    (default MEASURE_S) seconds: under sustained load an H200 runs at its power cap and its clock
    settles over a fraction of a second, so a short burst times a clock that training never sees, and
    taking turns gives every fn the same drift (docs/notes/). One fn's failure (out of memory, say)
    never stops the others."""
    cuda = device.type == "cuda"
    min_s = (MEASURE_S if min_s is None else min_s) if cuda else 0.0
    timers, spent, out, i = {n: [] for n in fns}, dict.fromkeys(fns, 0.0), {}, 0
    host = {n: [] for n in fns}
    while timers and (i == 0 or min(spent[n] for n in timers) < min_s):
        for name in list(timers):
            t0 = time.perf_counter()
            try:
                for _ in range(iters):
                    with _Timer(device) as t:
                        h0 = time.perf_counter()
                        r = fns[name](i)
                        host[name].append((time.perf_counter() - h0) * 1e3)
                    timers[name].append(t)
                    del r
                    i += 1
                if cuda:
                    torch.cuda.synchronize()
            except Exception as e:
                out[name] = e
                del timers[name]
                if cuda:
                    torch.cuda.empty_cache()
            spent[name] += time.perf_counter() - t0
    return {**out, **{name: (statistics.median(t.ms for t in ts), statistics.median(host[name]))
                      for name, ts in timers.items()}}


def _median_ms(fn, device: torch.device, iters: int, min_s: float | None = None) -> float:
    """Median time of fn(i), timed in rounds of `iters` calls for at least min_s seconds on GPUs."""
    ms = timed_rounds({0: fn}, device, iters, min_s)[0]
    if isinstance(ms, Exception):
        raise ms
    return ms[0]


def run_step(call, p: Problem, i: int, backward: bool):
    x, idx, w, dy = p.sets[i % len(p.sets)]
    out = call(x, idx, w, p.w1, p.w2)
    if backward:
        return out, torch.autograd.grad(out, (x, p.w1, p.w2, w), dy)
    return out, None


def reference_grads(p: Problem, dtype: torch.dtype = torch.float32):
    """The reference output and gradients for rotation set 0, in dtype (fp32; fp64 for the error of a kernel
    that changes the summation order against the old one's)."""
    x, idx, w, dy = p.sets[0]
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, p.w1, p.w2, w)]
    out = moe_experts_reference(leaves[0], idx, leaves[3], leaves[1], leaves[2],
                                experts=ExpertsConfig(p.activation))
    return (out.detach(),) + tuple(g.detach() for g in torch.autograd.grad(out, leaves, dy.to(dtype)))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def kernel_times(step, top: int | None = 15) -> list[tuple[str, int, float]]:
    """[(kernel, calls, total ms)] of one call of step() on the GPU, longest first (all if top is None)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t and getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type):
            rows.append((ev.key, ev.count, t / 1e3))
    return sorted(rows, key=lambda r: -r[2])[:top]


def steady_profile(step, steps: int = 10) -> dict:
    """step(i) called `steps` times back to back under torch.profiler, as a timing loop calls it (no sync in
    between), after the caller has warmed it up. Per step, in ms: span_ms (first kernel's start to last one's
    end), busy_ms (the union of the kernels' intervals: span minus it is time the GPU waits), kernels [(name,
    calls, ms)] longest first, and gaps [(ms, kernel before, kernel after)] longest first: where it waits.
    Kernel times here are the clocks of sustained work, not those of one step after an idle GPU."""
    def run():
        for i in range(steps):
            step(i)

    # no CPU events: their overhead would pace the host
    return kernel_summary(profile_trace(run, trace_kernels), steps)


def profile_trace(run, parse, cpu: bool = False):
    """parse(path) of the chrome trace of run() under torch.profiler: GPU kernels, and host events too where `cpu`
    (what a trace needs to tie each kernel to the host call that launched it). The GPU is idle before and after."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        return parse(path)


def kernel_summary(kernels: list[tuple[str, float, float]], steps: int = 1) -> dict:
    """steady_profile's numbers from kernels [(name, start µs, duration µs)] of `steps` steps."""
    kernels = sorted(kernels, key=lambda k: k[1])
    if not kernels:
        return dict(span_ms=0.0, busy_ms=0.0, kernels=[], gaps=[])
    span = max(ts + dur for _, ts, dur in kernels) - kernels[0][1]
    busy = sum(b - a for a, b in _union([(ts, ts + dur) for _, ts, dur in kernels]))
    per_kernel, gaps, end, last = {}, {}, kernels[0][1], kernels[0][0]
    for name, ts, dur in kernels:
        calls, us = per_kernel.get(name, (0, 0.0))
        per_kernel[name] = (calls + 1, us + dur)
        if ts > end:  # the GPU ran nothing from the end of `last` until this kernel started
            gaps[(last, name)] = gaps.get((last, name), 0.0) + ts - end
        if ts + dur >= end:
            end, last = ts + dur, name
    return dict(span_ms=span / 1e3 / steps, busy_ms=busy / 1e3 / steps,
                kernels=sorted(((k, c / steps, us / 1e3 / steps) for k, (c, us) in per_kernel.items()),
                               key=lambda r: -r[2]),
                gaps=sorted(((us / 1e3 / steps, a, b) for (a, b), us in gaps.items()), reverse=True))


def gpu_busy_ms(call, p: Problem) -> float:
    """Sum of the GPU kernel times of one forward+backward step. Against step_ms it shows how much of
    a step is host overhead (Python, launches) rather than GPU work."""
    return sum(ms for _, _, ms in kernel_times(lambda: run_step(call, p, 0, True), top=None))


WARMUP_S = 0.5  # seconds of warm-up steps on GPUs, beyond the first (compiling) one


def prepare(call, p: Problem, ref=None, warmup: int = 3, busy: bool = False) -> dict:
    """Compile and warm up one impl, then its rel_err (out, dx, dw1, dw2, dtopk_w against ref), kept_mb
    and peak_mb; with busy, also gpu_busy_ms (see gpu_busy_ms). Times come from time_interleaved."""
    cuda = p.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res = {}
    if ref is not None:
        out, grads = run_step(call, p, 0, True)
        names = ("out", "dx", "dw1", "dw2", "dtopk_w")
        res["rel_err"] = {n: _rel(a, b) for n, a, b in zip(names, (out,) + grads, ref)}
        del out, grads
    run_step(call, p, 0, True)  # the first step compiles (JIT, autotuning)
    sync()
    # Then at least `warmup` steps and, on GPUs, at least WARMUP_S seconds of them: measured first in
    # a process, SonicMoE at config A timed 25% slower than in the same process later (2.82 against
    # 2.25 ms after 3 warm-up steps), likely a GPU left idle at low clocks by minutes of JIT compiling.
    t0, i = time.perf_counter(), 1
    while i < warmup or (cuda and time.perf_counter() - t0 < WARMUP_S):
        run_step(call, p, i, True)
        sync()
        i += 1
    # memory: what forward leaves allocated (minus its output), and the peak over forward + backward
    x, idx, w, dy = p.sets[0]
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = call(x, idx, w, p.w1, p.w2)
        sync()
        res["kept_mb"] = (torch.cuda.memory_allocated() - base - out.untyped_storage().nbytes()) / MB
        grads = torch.autograd.grad(out, (x, p.w1, p.w2, w), dy)
        sync()
        res["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / MB
        del out, grads
    else:
        with SavedTensorCounter(exclude=(x, idx, w, p.w1, p.w2)) as c:
            out = call(x, idx, w, p.w1, p.w2)
        res["kept_mb"], res["peak_mb"] = c.total_bytes / MB, None
        del out
    if busy and cuda:
        res["gpu_busy_ms"] = gpu_busy_ms(call, p)
    return res


def time_interleaved(calls: dict, p: Problem, iters: int = 10, min_s: float | None = None) -> dict:
    """{name: {"fwd_ms", "step_ms", "host_ms", "tflops"} or the exception that stopped it} for prepared
    impls on one problem, timed in turns (timed_rounds): all see the same clocks, so their ratios are
    not skewed by the GPU's power state drifting between one impl's timing and the next. host_ms is the
    host time to issue one forward+backward step: where it nears step_ms, the step is launch-bound."""
    out = {name: {} for name in calls}
    for key, backward in (("fwd_ms", False), ("step_ms", True)):
        fns = {n: (lambda i, c=c, b=backward: run_step(c, p, i, b))
               for n, c in calls.items() if not isinstance(out[n], Exception)}
        for name, ms in timed_rounds(fns, p.device, iters, min_s).items():
            if isinstance(ms, Exception):
                out[name] = ms
            else:
                out[name][key] = ms[0]
                if backward:
                    out[name]["host_ms"] = ms[1]
    for res in out.values():
        if not isinstance(res, Exception):
            res["tflops"] = p.flops / (res["step_ms"] * 1e-3) / 1e12
    return out


# ---- dispatch: routing index builders --------------------------------------------------------------

def _argsort_bincount_cumsum(idx: torch.Tensor, E: int):
    flat = idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    return order, count_per_expert(flat, E).cumsum(0)


DISPATCH = {
    "dense": lambda idx, E: build_routing_index(idx, E, "dense", check=False),
    "sort": lambda idx, E: build_index_sort(idx, E),
    "argsort_bincount_cumsum": _argsort_bincount_cumsum,
}


def time_dispatch(L: int, E: int, K: int, device, iters: int = 20) -> dict:
    """Median ms of each routing-index builder on one uniform routing, after checking dense == sort."""
    g = torch.Generator(device="cpu").manual_seed(L * 131 + E * 7 + K)
    idx = torch.randn(L, E, generator=g).topk(K, dim=-1).indices.to(torch.int32).to(device)
    a, b = DISPATCH["dense"](idx, E), DISPATCH["sort"](idx, E)
    if not all(torch.equal(u, v) for u, v in zip(a.tensors(), b.tensors())):
        raise AssertionError(f"dense and sort builders disagree at L={L} E={E} K={K}")
    res = {}
    for name, fn in DISPATCH.items():
        for _ in range(3):
            fn(idx, E)
        res[name] = _median_ms(lambda i: fn(idx, E), torch.device(device), iters, min_s=0.2)  # noqa: B023
    return res
