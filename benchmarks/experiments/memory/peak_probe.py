"""What is allocated at the peak of one training step of the layer benchmark: the allocator's history over one
forward+backward, replayed to the peak, the live blocks there listed by size with the moeblaze frame that made them.

usage: python benchmarks/experiments/memory/peak_probe.py [--configs E,D] [--impls moeblaze,moeblaze-fp8]
                                                           [--policy preact]
"""
from __future__ import annotations

import argparse
import collections

import torch

from moeblaze.bench.harness import IMPLS, make_problem, run_step
from moeblaze.bench.names import CONFIGS

MB = 2 ** 20


def frame_of(frames) -> str:
    """The innermost moeblaze frame (or the innermost frame) of an allocation's stack."""
    for f in frames:
        if "moeblaze" in f["filename"] and "bench" not in f["filename"]:
            return f"{f['filename'].split('moeblaze/')[-1]}:{f['line']} {f['name']}"
    for f in frames:
        if "harness" in f["filename"] or "sonicmoe" in f["filename"]:
            return f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}"
    return frames[0]["filename"].split("/")[-1] + f":{frames[0]['line']}" if frames else "?"


def probe(name, impl, policy, p):
    call = IMPLS[impl][2](p, policy)
    for i in range(3):
        run_step(call, p, i, True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    out, grads = run_step(call, p, 0, True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    del out, grads
    events = [e for t in snap["device_traces"] for e in t]
    live, cur, best, best_live = {}, 0, -1, {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > best:
                best, best_live = cur, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    print(f"{name} {impl}/{policy}: peak above baseline {peak / MB:.1f} MB (replayed {best / MB:.1f} MB from "
          f"allocations made in the step); live at the peak:")
    by = collections.defaultdict(lambda: [0, 0])
    for e in best_live.values():
        k = frame_of(e.get("frames", []))
        by[k][0] += e["size"]
        by[k][1] += 1
    for k, (size, n) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        if size >= MB:
            print(f"   {size / MB:9.1f} MB {n:3d}x  {k}")
    last = max(best_live.values(), key=lambda e: e.get("time_us", 0), default=None)
    if last:
        print(f"   the allocation that made the peak: {last['size'] / MB:.1f} MB at {frame_of(last.get('frames', []))}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="E,D")
    ap.add_argument("--impls", default="moeblaze,moeblaze-fp8")
    ap.add_argument("--policy", default="preact")
    a = ap.parse_args()
    for c in a.configs.split(","):
        L, d, h, E, K = CONFIGS[c]
        p = make_problem(L, d, h, E, K, "swiglu", dtype=torch.bfloat16, device=torch.device("cuda"), n_sets=1)
        for impl in a.impls.split(","):
            probe(c, impl, a.policy if impl.startswith("moeblaze") else "-", p)
        del p
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
