"""Where a profiled step leaves the GPU idle, from a chrome trace (`moeblaze train --bench-steps N --bench-profile
--bench-trace FILE`): the idle time by cause (waiting for the host: what the host was doing, and in which op it
launched the work that ended the wait; or waiting on a dependency: another stream, an event), then the longest gaps.

    python scripts/trace_gaps.py TRACE.json[.gz] [--min-ms 0.05] [--top 15]
"""
import argparse
import gzip
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from moeblaze.bench.timeline import gpu_work, idle_gaps  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--min-ms", type=float, default=0.05, help="shortest gap counted (default 0.05 ms)")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    with (gzip.open if args.trace.endswith(".gz") else open)(args.trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    work = gpu_work(events)
    if not work:
        print(f"no GPU activity in {args.trace}", file=sys.stderr)
        return 1
    span = (max(e["ts"] + e["dur"] for e in work) - min(e["ts"] for e in work)) / 1e3
    gaps = idle_gaps(events, args.min_ms * 1e3)
    print(f"GPU span {span:.2f} ms; idle in gaps of >= {args.min_ms} ms: {sum(g['ms'] for g in gaps):.2f} ms "
          f"in {len(gaps)} gaps")
    by = defaultdict(lambda: [0.0, 0])
    for g in gaps:
        key = (g["cause"], g["host_op"] or "-", (g["launched_in"] or ["-"])[-1])
        by[key][0] += g["ms"]
        by[key][1] += 1
    print(f"{'idle ms':>8} {'gaps':>5}  cause, the host busy with, launched in")
    for (cause, busy, where), (ms, n) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        print(f"{ms:8.2f} {n:5d}  {cause}, {busy[:50]}, {where[:50]}")
    print(f"the {args.top} longest gaps (ms, next GPU work, cause, launched in):")
    for g in gaps[:args.top]:
        print(f"{g['ms']:8.2f}  {g['next'][:60]}  {g['cause']}  {' > '.join(g['launched_in'] or [])[:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
