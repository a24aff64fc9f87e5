"""The weak-scaling table and plot of one `bash scripts/scaling.sh` run, from its results rows (mode "train").

    python scripts/scaling_report.py RESULTS.jsonl [--png OUT.png] [--sha COMMIT]   the markdown table on stdout
    python scripts/scaling_report.py --titan TITAN.jsonl [--png P]   torchtitan's benchmark (scaling.sh titan): its
                                                                     table (and plot)

RESULTS is one run's file ($OUT/results/<gpu>.jsonl), or the results file with --sha picking one commit's rows.

Rows of the same launch (preset, GPUs, layout, flags) are one entry: the median step over its runs (the runs
counted), and tokens/s per GPU at that step. Efficiency is tokens/s per GPU over the one-GPU plain run's (no
torchrun) with the same preset, batch per GPU and flags (--cuda-graph, --compile); a preset with no such run (one
that fits no single GPU) has none. The plot draws, per preset, tokens/s per GPU and efficiency against the number
of GPUs, a line per layout, ep = N layouts joined across N.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from typing import NamedTuple

SPLIT = ("gemm_ms", "all_to_all_ms", "allgather_reducescatter_ms", "exposed_comm_ms")


def layout(r: dict) -> str:
    """The launch's layout, named without its number of GPUs where ep = N (so that one line joins them)."""
    units = r.get("fsdp_units", "blocks" if r["world"] > 1 else "-")  # rows from before --fsdp-units
    if units == "-":
        return "-"
    extras = "".join([", one unit" if units == "model" else "",
                      ", keep gathered" if r.get("keep_gathered") else "",
                      ", bf16 reductions" if r.get("reduce_dtype") == "bfloat16" else ""])
    if r["ep"] == 1:
        return "FSDP2 (ep 1)" + extras
    ep = "ep N" if r["ep"] == r["world"] else f"ep {r['ep']}"
    cap = f" {r['capacity_factor']}" if r["dispatch"] == "capacity" else ""
    chunks = f" in {r['ep_chunks']} groups" if r.get("ep_chunks", 1) > 1 else ""
    return f"{ep}, {r['dispatch']}{cap}{chunks}" + extras


class Flags(NamedTuple):
    """What must match between a run and the one-GPU run it is measured against."""
    preset: str
    batch: int
    seq: int
    dtype: str
    compiled: bool
    graph: bool


def flags(r: dict) -> Flags:
    return Flags(r["preset"], r["batch_per_gpu"], r["seq"], r["dtype"], r.get("compiled", False),
                 r.get("cuda_graph", False))


def entries(rows: list[dict]) -> list[dict]:
    """One entry per launch: the medians of its runs, its efficiency (None without a one-GPU plain run)."""
    groups = defaultdict(list)
    for r in rows:
        if r.get("mode") == "train" and r.get("status") == "ok":
            groups[(flags(r), r["world"], layout(r))].append(r)
    step = {k: statistics.median(x["step_ms"] for x in g) for k, g in groups.items()}
    base = {k[0]: step[k] for k in groups if k[1] == 1 and k[2] == "-"}
    out = []
    for (fl, world, lay), g in groups.items():
        ms = step[fl, world, lay]
        tok = fl.batch * fl.seq / ms * 1e3  # the same tokens per GPU at every N: efficiency is a ratio of steps
        splits = [x["split"] for x in g if x.get("split")]
        out.append(dict(
            preset=fl.preset, batch=fl.batch, seq=fl.seq, graph=fl.graph, compiled=fl.compiled, world=world,
            layout=lay, runs=len(g),
            step_ms=ms, tokens_s_per_gpu=tok,
            efficiency=base[fl] / ms if fl in base else None, peak_gb=max(x["peak_gb"] for x in g),
            split=[statistics.median(s.get(k, 0.0) for s in splits) for k in SPLIT] if splits else None,
            loss=statistics.median(x["loss"] for x in g)))
    return sorted(out, key=lambda e: (e["preset"], e["graph"], e["compiled"], e["batch"], e["layout"] != "-",
                                      e["layout"], e["world"]))


def table(es: list[dict]) -> str:
    head = ("| model, batch per GPU | GPUs | layout | runs | step ms | tokens/s per GPU | efficiency | peak GB per GPU "
            "| GEMMs / all-to-all / all-gather + reduce-scatter / exposed comm, ms | loss |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for e in es:
        model = f"{e['preset']}, {e['batch']} x {e['seq']}" + (", --cuda-graph" if e["graph"] else "") + (
            ", --compile" if e["compiled"] else "")
        eff = "-" if e["efficiency"] is None else f"{e['efficiency']:.2f}"
        split = "" if e["split"] is None else " / ".join(f"{v:.2f}" for v in e["split"])
        lines.append(f"| {model} | {e['world']} | {e['layout']} | {e['runs']} | {e['step_ms']:.2f} | "
                     f"{e['tokens_s_per_gpu']:,.0f} | {eff} | {e['peak_gb']:.2f} | {split} | {e['loss']:.4f} |")
    return "\n".join(lines)


def plot(es: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({(e["preset"], e["batch"], e["graph"], e["compiled"]) for e in es})
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.2 * len(models)), squeeze=False)
    for (ax_tok, ax_eff), m in zip(axes, models):
        lines = defaultdict(list)
        for e in es:
            if (e["preset"], e["batch"], e["graph"], e["compiled"]) == m:
                lines[e["layout"]].append(e)
        one = lines.pop("-", [])
        for lay, pts in sorted(lines.items()):
            pts = sorted(one + pts, key=lambda e: e["world"])  # each line starts at the one-GPU run
            ns = [e["world"] for e in pts]
            ax_tok.plot(ns, [e["tokens_s_per_gpu"] for e in pts], marker="o", label=lay)
            eff = [(e["world"], e["efficiency"]) for e in pts if e["efficiency"] is not None]
            if eff:
                ax_eff.plot(*zip(*eff), marker="o", label=lay)
        title = f"{m[0]}, batch {m[1]} per GPU" + (", CUDA graph" if m[2] else "") + (", compiled" if m[3] else "")
        ax_tok.set_title(title, fontsize=9)
        ax_tok.set_ylabel("tokens/s per GPU")
        ax_eff.set_ylabel("weak-scaling efficiency")
        ax_eff.axhline(0.9, color="grey", lw=0.8, ls="--")
        top = max([1.0] + [e["efficiency"] or 0 for pts in lines.values() for e in pts])
        ax_eff.set_ylim(0, top + 0.05)
        _gpu_axes(ax_tok, ax_eff, {e["world"] for pts in lines.values() for e in one + pts})
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _gpu_axes(ax_tok, ax_eff, worlds) -> None:
    """Both plots' x axis, the numbers of GPUs on a log-2 scale, their grid, and the legend."""
    ns = sorted(worlds)
    for ax in (ax_tok, ax_eff):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
    ax_tok.legend(fontsize=7)


def _titan_runs(rows: list[dict]) -> list[dict]:
    """The timed runs among torchtitan's benchmark rows (not out-of-memory probes or largest-batch summaries)."""
    return [r for r in rows if not r.get("oom") and "tokens_per_s" in r and not r.get("max_batch_probe")]


def _fsdp_options(r: dict) -> str:
    """An FSDP2 row's options: ", kept gathered" where its blocks keep their gathered weights to backward
    (--keep-gathered), ", bf16 reductions" where its gradients are reduced in bf16 (--reduce-dtype bfloat16),
    ", prefetch N" where each unit issues the next N units' all-gathers (--fsdp-prefetch N)."""
    return "".join([", kept gathered" if r.get("keep_gathered") else "",
                    ", bf16 reductions" if r.get("reduce_dtype") == "bfloat16" else "",
                    f", prefetch {r['fsdp_prefetch']}" if r.get("fsdp_prefetch") else ""])


def titan_table(rows: list[dict]) -> str:
    """benchmarks/torchtitan_train.py's rows (scaling.sh titan) as one table: per experts variant and parallelism
    (one GPU, FSDP2 (its options: _fsdp_options), expert parallelism; moeblaze's own EP where the variant names
    +exact or +capacity), tokens/s of
    the job and per GPU, scaling against the same variant on one GPU, peak memory of rank 0, and each variant
    against torchtitan's own experts ("default") at the same GPUs and parallelism."""
    def mode(r):
        if r["world"] == 1:
            return "1 GPU"
        return f"EP {r['ep']}" if r["ep"] > 1 else f"FSDP2 {r['world']}" + _fsdp_options(r)

    ok = _titan_runs(rows)
    one = {(r["variant"].split("+")[0], r["batch"]): r["tokens_per_s"] for r in ok if r["world"] == 1}
    by_mode = {(mode(r), r["batch"], r["variant"]): r["tokens_per_s"] for r in ok}
    out = ["| experts | parallelism | GPUs | batch / GPU | tokens/s | per GPU | scaling | vs torchtitan's | peak GiB | "
           "GEMMs / all-to-all / all-gather + reduce-scatter / exposed comm, ms |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(ok, key=lambda r: (r["world"], mode(r), r["variant"])):
        per = r["tokens_per_s"] / r["world"]
        base = one.get((r["variant"].split("+")[0], r["batch"]))
        theirs = by_mode.get((mode(r), r["batch"], "default"))
        scaling = f"{per / base:.2f}" if base else "-"
        vs = f"{r['tokens_per_s'] / theirs:.2f}x" if theirs else "-"
        split = " / ".join(f"{r[k]:.1f}" for k in SPLIT) if all(k in r for k in SPLIT) else "-"
        out.append(f"| {r['variant']} | {mode(r)} | {r['world']} | {r['batch']} | {r['tokens_per_s']:,} | {per:,.0f} | "
                   f"{scaling} | {vs} | {r.get('peak_gib') or '-'} | {split} |")
    return "\n".join(out)


def titan_plot(rows: list[dict], path: str) -> None:
    """tokens/s per GPU and scaling against the number of GPUs: a line per experts variant and parallelism (FSDP2,
    EP = N), each starting at that variant's one-GPU run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = _titan_runs(rows)
    one = {r["variant"]: r for r in ok if r["world"] == 1}
    lines = defaultdict(list)
    for r in ok:
        if r["world"] > 1:
            lines[(r["variant"], "EP N" if r["ep"] > 1 else "FSDP2" + _fsdp_options(r))].append(r)
    fig, (ax_tok, ax_eff) = plt.subplots(1, 2, figsize=(10, 3.4))
    for (variant, par), pts in sorted(lines.items()):
        first = one.get(variant.split("+")[0])
        pts = sorted(([first] if first else []) + pts, key=lambda r: r["world"])
        ns = [r["world"] for r in pts]
        per = [r["tokens_per_s"] / r["world"] for r in pts]
        ax_tok.plot(ns, per, marker="o", label=f"{variant}, {par}")
        if first:
            ax_eff.plot(ns, [p / first["tokens_per_s"] for p in per], marker="o", label=f"{variant}, {par}")
    ax_tok.set_ylabel("tokens/s per GPU")
    ax_eff.set_ylabel("scaling (per GPU / one GPU)")
    ax_eff.axhline(0.93, color="grey", lw=0.8, ls="--")
    _gpu_axes(ax_tok, ax_eff, {r["world"] for r in ok})
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="?")
    p.add_argument("--png", help="also draw the plot here")
    p.add_argument("--sha", help="only the rows of this commit")
    p.add_argument("--titan", help="torchtitan's benchmark rows (scaling.sh titan): print their table instead")
    args = p.parse_args(argv)
    if args.titan:
        with open(args.titan) as f:
            rows = [json.loads(line) for line in f if line.strip().startswith("{")]
        print(titan_table(rows))
        if args.png:
            titan_plot(rows, args.png)
        return 0
    if args.results is None:
        p.error("RESULTS (or --titan) is needed")
    with open(args.results) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    es = entries([r for r in rows if args.sha is None or r.get("git_sha") == args.sha])
    if not es:
        print(f"no training rows (mode 'train'{', commit ' + args.sha if args.sha else ''}) in {args.results}",
              file=sys.stderr)
        return 1
    print(table(es))
    if args.png:
        plot(es, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
