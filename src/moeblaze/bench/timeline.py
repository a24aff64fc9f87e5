"""Where a training step's GPU time goes, from a profiler trace (the chrome-trace JSON torch.profiler exports):
GEMMs (the experts' kernels, cuBLAS / cuDNN matmuls and attention), other compute, all-to-all (expert parallelism:
NCCL send/recv), all-gather + reduce-scatter (+ all-reduce: FSDP2 and the loss and norm reductions), and the
communication that no compute overlaps (exposed): the length of the union of the communication kernels' intervals
minus its intersection with the union of the compute kernels' intervals; and each collective's own exposed time
(its kernels' time with no compute under it: where the exposed time sits).

Memory: the trace's kernel events, once.
"""
from __future__ import annotations

import json
import re

GEMM = re.compile(r"gemm|matmul|mma|nvjet|cutlass|xmma|flash|fmha|attention|_up_kernel|_rows_kernel|up_swiglu|"
                  r"_down_bwd_kernel|weight_grad_kernel", re.IGNORECASE)
ALL_TO_ALL = re.compile(r"nccl.*(SendRecv|AllToAll|Send|Recv)", re.IGNORECASE)
COLLECTIVE = re.compile(r"nccl.*(AllGather|ReduceScatter|AllReduce|Broadcast)", re.IGNORECASE)
PARTS = ("gemm_ms", "other_compute_ms", "all_to_all_ms", "allgather_reducescatter_ms")
# the exposed_<name>_ms keys, by the collective NCCL names in its kernel (all_to_all: expert parallelism's SendRecv)
EXPOSED_BY = {"allgather": re.compile("AllGather", re.I), "reducescatter": re.compile("ReduceScatter", re.I),
              "allreduce": re.compile("AllReduce", re.I), "all_to_all": ALL_TO_ALL}


def kind(name: str) -> str:
    """The part of PARTS a kernel belongs to, by its name."""
    if ALL_TO_ALL.search(name):
        return "all_to_all_ms"
    if COLLECTIVE.search(name) or name.lower().startswith("nccl"):
        return "allgather_reducescatter_ms"
    return "gemm_ms" if GEMM.search(name) else "other_compute_ms"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(u: list[tuple[float, float]], v: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(u) and j < len(v):
        a, b = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        total += max(0.0, b - a)
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


def step_split(kernels: list[tuple[str, float, float]], steps: int = 1) -> dict:
    """kernels: (name, start µs, duration µs) of the GPU kernels of `steps` steps; per step, in ms: each part's
    summed kernel time, busy_ms (the union of all kernels' intervals), exposed_comm_ms, and exposed_<c>_ms for
    each collective c of EXPOSED_BY: its kernels' time that no compute overlaps (two collectives running at once
    each count theirs, so these may add up to more than exposed_comm_ms)."""
    parts = dict.fromkeys(PARTS, 0.0)
    comm, comm_names, compute = [], [], []
    for name, ts, dur in kernels:
        k = kind(name)
        parts[k] += dur
        if k in ("all_to_all_ms", "allgather_reducescatter_ms"):
            comm.append((ts, ts + dur))
            comm_names.append(name)
        else:
            compute.append((ts, ts + dur))
    comm_u, compute_u = _union(comm), _union(compute)
    exposed = _length(comm_u) - _overlap(comm_u, compute_u)
    by = dict.fromkeys(EXPOSED_BY, 0.0)
    for name, (a, b) in zip(comm_names, comm):
        c = next((c for c, pattern in EXPOSED_BY.items() if pattern.search(name)), None)
        if c is not None:
            by[c] += b - a - _overlap([(a, b)], compute_u)
    busy = _length(_union(comm + compute))
    out = {k: v / 1e3 / steps for k, v in parts.items()}
    out.update(busy_ms=busy / 1e3 / steps, exposed_comm_ms=exposed / 1e3 / steps)
    out.update({f"exposed_{c}_ms": v / 1e3 / steps for c, v in by.items()})
    return out


def trace_kernels(path: str) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every GPU kernel in a chrome trace torch.profiler exported."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    return [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
            if e.get("ph") == "X" and e.get("cat") == "kernel"]


GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_work(events: list[dict]) -> list[dict]:
    """The GPU's activity among a chrome trace's events: kernels, copies and memsets."""
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_WORK]


def idle_gaps(events: list[dict], min_us: float = 100.0) -> list[dict]:
    """The GPU's idle gaps of at least min_us between its first and last activity, longest first: each gap's
    length (ms), the activity that ends it, and why it waited. "host": that activity was launched after the gap
    began, so the GPU waited for the host; `host_op` is then the innermost profiled op running on the launching
    thread when the gap began (what the host was busy with) and `launched_in` the ops the launch sits in,
    outermost first. "dependency": it was launched before, so it waited on another stream or an event.
    events: a chrome trace's traceEvents (torch.profiler)."""
    work = sorted(((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e) for e in gpu_work(events)),
                  key=lambda w: w[:2])  # by time only: two activities at the same times are not ordered further
    launches = {e["args"]["correlation"]: e for e in events if e.get("ph") == "X"
                and e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops: dict = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"):
            ops.setdefault(e["tid"], []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]))

    for v in ops.values():
        v.sort(key=lambda o: (o[0], -o[1]))  # an op before the ops it encloses

    def around(tid, t):  # the ops on thread tid running at time t, outermost first
        return [name for a, b, name in ops.get(tid, ()) if a <= t < b]

    gaps, end = [], None
    for a, b, e in work:
        if end is not None and a - end >= min_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            gap = dict(ms=(a - end) / 1e3, next=e["name"][:80], cause="dependency", host_op=None, launched_in=None)
            if launch is not None and float(launch["ts"]) > end:
                busy = around(launch["tid"], end)
                gap.update(cause="host", host_op=busy[-1] if busy else "(no profiled op)",
                           launched_in=around(launch["tid"], float(launch["ts"]))[:-1])
            gaps.append(gap)
        end = b if end is None else max(end, b)
    return sorted(gaps, key=lambda g: -g["ms"])
