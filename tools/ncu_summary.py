"""The figures that matter from an Nsight Compute CSV, one line per launch or per hot instruction.

    ncu --csv --page details ... > details.csv;  python tools/ncu_summary.py details details.csv
        each launch: duration, SM clock, tensor-pipe activity, memory, L2 and DRAM throughput, registers
    ncu --csv --page source --print-source sass --section SourceCounters ... > sass.csv
    python tools/ncu_summary.py source sass.csv [--top 25]
        the instructions with the most warp-stall samples, and the samples by opcode
"""
from __future__ import annotations

import argparse
import collections
import csv

DETAILS = ("Duration", "SM Frequency", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
           "Memory Throughput", "L2 Cache Throughput", "DRAM Throughput", "Registers Per Thread")


def _table(path: str, first: str):
    rows = list(csv.reader(open(path)))
    start = next(i for i, r in enumerate(rows) if r and first in r)
    return rows[start], rows[start + 1:]


def details(path: str) -> None:
    head, rows = _table(path, "Metric Name")
    col = {k: head.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Value", "Metric Unit")}
    launches: dict = collections.defaultdict(dict)
    names = {}
    for r in rows:
        if len(r) > col["Metric Value"] and r[col["Metric Name"]] in DETAILS:
            launches[r[col["ID"]]][r[col["Metric Name"]]] = f"{r[col['Metric Value']]} {r[col['Metric Unit']]}".strip()
            names[r[col["ID"]]] = r[col["Kernel Name"]][:40]
    for i, m in launches.items():
        print(i, names[i], "; ".join(f"{k.split('.')[0]}: {m[k]}" for k in DETAILS if k in m))


def source(path: str, top: int) -> None:
    head, rows = _table(path, "Source")
    src = head.index("Source")
    samples = next(i for i, c in enumerate(head) if c.startswith("Warp Stall Sampling (All"))
    lines, by_op = [], collections.Counter()
    for r in rows:
        try:
            v = float(r[samples] or 0)
        except (ValueError, IndexError):
            continue
        lines.append((v, r[src].strip()))
        by_op[r[src].split()[0] if r[src].split() else "?"] += v
    total = sum(v for v, _ in lines) or 1.0
    print(f"{head[samples]}: {total:.0f} samples")
    for v, s in sorted(lines, reverse=True)[:top]:
        print(f"{v:8.0f} {100 * v / total:5.1f}%  {s[:100]}")
    print("by opcode:", ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_op.most_common(12)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("page", choices=("details", "source"))
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    details(a.csv) if a.page == "details" else source(a.csv, a.top)


if __name__ == "__main__":
    main()
