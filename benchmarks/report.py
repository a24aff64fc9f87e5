"""Charts and the docs' generated sections, made from `moeblaze bench`'s JSON lines (outside the package:
plotting is the lab's, not the library's).

    python benchmarks/report.py RESULTS_DIR --plot                   PNG charts of the latest run, beside its rows
    python benchmarks/report.py RESULTS_DIR --report docs/results.md   a page's generated sections, and the charts

A page's generated sections lie between markers `<!-- NAME:start -->` and `<!-- NAME:end -->`: "results" (every
layer row of the run that measured SonicMoE, the routing and scaling tables) and "standing" (the headline run's
summary table, docs/performance.md).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict


def load_rows(results_dir: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.jsonl"))):
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def _label(r: dict) -> str:
    if "impl" not in r:  # a dispatch row times every builder
        return ",".join(sorted(r.get("dispatch_ms") or {}))
    return r["impl"] if r.get("policy") in (None, "-") else f"{r['impl']}/{r['policy']}"


def _cfg(r: dict) -> str:
    return f"{r['L']},{r['d']},{r['h']},{r['E']},{r['K']}"


def _cfg_order(cfg: str) -> tuple:
    """Named configs A-E first, in their order, then the others."""
    from moeblaze.bench.names import CONFIGS

    named = [",".join(map(str, c)) for c in CONFIGS.values()]
    return (named.index(cfg), "") if cfg in named else (len(named), cfg)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")  # as moeblaze bench names its files


def plot_run(rows: list[dict], out_dir: str, name: str | None = None) -> list[str]:
    """PNG charts of the layer rows (time and kept memory per config) and of the scale rows (time and
    memory per token against tokens); file names carry `name` or the run id."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    run_id = rows[0]["run_id"] if rows else "none"
    layer = [r for r in rows if r.get("mode") == "layer"]
    if layer:
        cfgs = sorted(dict.fromkeys(_cfg(r) for r in layer), key=_cfg_order)
        labels = list(dict.fromkeys(_label(r) for r in layer))
        fig, axes = plt.subplots(1, 2, figsize=(14, 5))
        panels = ((axes[0], "step_ms", "forward+backward (ms)"), (axes[1], "kept_mb", "kept for backward (MB)"))
        for ax, key, title in panels:
            width = 0.8 / len(labels)
            for i, lab in enumerate(labels):
                vals = [next((r[key] or 0 for r in layer
                              if _cfg(r) == c and _label(r) == lab and r["status"] == "ok"), 0)
                        for c in cfgs]
                ax.bar([j + i * width for j in range(len(cfgs))], vals, width, label=lab)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cfgs))], cfgs, rotation=20, fontsize=7)
            ax.set_title(title)
            ax.set_xlabel("L,d,h,E,K")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"MoE layer, {layer[0]['activation']} {layer[0]['dtype']}, {layer[0]['gpu']} "
                     f"(runs {', '.join(dict.fromkeys(r['run_id'] for r in layer))})")
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"{name or 'layer-' + run_id}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    scale = [r for r in rows if r.get("mode") == "scale"]
    if scale:
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        by = defaultdict(list)
        for r in scale:
            if r["status"] == "ok":
                by[_label(r)].append(r)
        for lab, rs in by.items():
            axes[0].plot([r["L"] for r in rs], [r["step_ms"] for r in rs], "o-", label=lab)
            mem = "peak_mb" if rs[0]["peak_mb"] is not None else "kept_mb"  # the CPU has no allocator peak
            axes[1].plot([r["L"] for r in rs], [r[mem] * 1024 / r["L"] for r in rs], "o-", label=lab)
        for ax, t in ((axes[0], "forward+backward (ms)"), (axes[1], "memory per token (KB): peak on GPU, kept on CPU")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens")
            ax.set_title(t)
        axes[0].set_yscale("log")
        axes[0].legend(fontsize=8)
        s0 = scale[0]
        fig.suptitle(f"scaling, d,h,E,K = {s0['d']},{s0['h']},{s0['E']},{s0['K']}, {s0['gpu']}")
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"{name or 'scale-' + run_id}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


# the headline's series: (implementation, policy) as the rows name them, and the label each gets
HEADLINE = ((("torch_gmm", "-"), "torch grouped_mm"), (("sonicmoe", "-"), "SonicMoE"),
            (("moeblaze", "preact"), "moeblaze bf16"), (("moeblaze-fp8", "preact"), 'moeblaze precision="fp8"'),
            (("moeblaze", "recompute"), "moeblaze recompute"))


def headline_run(rows: list[dict]) -> list[dict]:
    """The layer rows of the newest run that measured every headline series at every config it measured."""
    want = {key for key, _ in HEADLINE}
    runs = defaultdict(list)
    for r in rows:
        if r.get("mode") == "layer" and r.get("gpu") != "cpu" and r.get("status") == "ok":
            runs[r["run_id"]].append(r)
    whole = [rs for rs in runs.values()
             if all(want <= {(r["impl"], r["policy"]) for r in rs if _cfg(r) == c} for c in {_cfg(r) for r in rs})]
    return max(whole, key=lambda rs: rs[0]["date"]) if whole else []


def plot_headline(rows: list[dict], path: str) -> str | None:
    """The front page's chart from one run (headline_run): per config, each headline series' step time and peak
    memory (kept for backward drawn solid inside it) as multiples of SonicMoE's in the same run, SonicMoE's own
    under the axis; the title names the GPU, the date and the commit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeblaze.bench.names import CONFIGS

    run = headline_run(rows)
    if not run:
        return None
    cfgs = sorted({_cfg(r) for r in run}, key=_cfg_order)
    names = {",".join(map(str, v)): k for k, v in CONFIGS.items()}

    def row(c, key):
        return next(r for r in run if _cfg(r) == c and (r["impl"], r["policy"]) == key)

    sonic = {c: row(c, ("sonicmoe", "-")) for c in cfgs}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(HEADLINE)
    for i, (key, label) in enumerate(HEADLINE):
        got = [row(c, key) for c in cfgs]
        xs = [j + i * width for j in range(len(cfgs))]
        axes[0].bar(xs, [r["step_ms"] / sonic[c]["step_ms"] for r, c in zip(got, cfgs)], width, label=label,
                    color=f"C{i}")
        axes[1].bar(xs, [r["peak_mb"] / sonic[c]["peak_mb"] for r, c in zip(got, cfgs)], width, color=f"C{i}",
                    alpha=0.45)
        axes[1].bar(xs, [r["kept_mb"] / sonic[c]["peak_mb"] for r, c in zip(got, cfgs)], width, color=f"C{i}")
    for ax, title, key, unit in ((axes[0], "training step (forward + backward) / SonicMoE's: lower is faster",
                                  "step_ms", "ms"),
                                 (axes[1], "peak memory of the step / SonicMoE's (solid: kept for backward)",
                                  "peak_mb", "MB")):
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cfgs))],
                      [f"{names.get(c, c)}: L={int(c.split(',')[0]) // 1024}k, E={c.split(',')[3]}\n"
                       f"SonicMoE {sonic[c][key]:.{1 if unit == 'ms' else 0}f} {unit}" for c in cfgs], fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8, loc="upper left")
    r0 = run[0]
    fig.suptitle(f"one SwiGLU MoE layer, {r0['dtype']}, {r0['gpu']}, {r0['date'][:10]}, commit {r0['git_sha']} "
                 f"(run {r0['run_id']}; configs in docs/results.md)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latest_rows(rows: list[dict], mode: str) -> list[dict]:
    """GPU rows of `mode`: per config (layer, dispatch) all rows of one run, so ratios are only taken
    inside one run: the newest run that measured moeblaze beside SonicMoE (the bar), else the one that
    compared the most implementations, newest among equals; per (tokens, implementation) the newest
    row (scale)."""
    rs = [r for r in rows if r.get("mode") == mode and r.get("gpu") != "cpu"]
    if mode == "scale":
        newest = {}
        for r in sorted(rs, key=lambda r: r["date"]):
            newest[(r["L"], _label(r))] = r
        return list(newest.values())
    runs = {}  # (config, gpu) -> {run_id: (labels measured, newest date)}
    for r in rs:
        labels, date = runs.setdefault((_cfg_key(r), r["gpu"]), {}).get(r["run_id"], (set(), ""))
        runs[(_cfg_key(r), r["gpu"])][r["run_id"]] = (labels | {_label(r)}, max(date, r["date"]))
    def rank(labels_date):
        labels, date = labels_date
        beside_sonic = {"moeblaze", "sonicmoe"} <= {lb.split("/")[0] for lb in labels}
        # runs beside SonicMoE first, newest first; then the most implementations, newest among equals
        return (beside_sonic, date if beside_sonic else "", len(labels), date)
    best = {k: max(v, key=lambda run: rank(v[run])) for k, v in runs.items()}
    return [r for r in rs if best[(_cfg_key(r), r["gpu"])] == r["run_id"]]


def _cfg_key(r: dict) -> str:
    return f"{r['L']},{r['E']},{r['K']}" if r.get("mode") == "dispatch" else _cfg(r)


def _runs(rows: list[dict]) -> str:
    runs = {}
    for r in rows:
        runs.setdefault(r["run_id"], r)
    return "; ".join(f"run {k} (commit {r['git_sha']}, {r['date'][:16]}): `{r['command']}`" for k, r in runs.items())


def _short_gpu(r: dict) -> str:
    """The GPU's model as a heading names it (NVIDIA H100 80GB HBM3 -> one H100)."""
    words = r["gpu"].split()
    return "one " + (words[1] if len(words) > 1 and words[0] == "NVIDIA" else r["gpu"])


def _layer_line(name: str, r: dict, baseline_ms: float | None, gmm_ms: float | None = None) -> str:
    """One table line of a layer row; its ratio columns are baseline_ms (and gmm_ms) / its step time."""
    if r["status"] != "ok":
        return f"| {name} | {_label(r)} | {r['status'][:60]} |  |  |  |  |  |  |  |  |  |"
    vs = f"{baseline_ms / r['step_ms']:.2f}" if baseline_ms else "-"
    vs += f" | {gmm_ms / r['step_ms']:.2f}" if gmm_ms else " | -"
    err = f"{max(r['rel_err'].values()):.1e}" if r.get("rel_err") else "-"
    host = f"{r['host_ms']:.2f}" if r.get("host_ms") is not None else "-"  # rows before host_ms have none
    busy = f"{r['gpu_busy_ms']:.2f}" if r.get("gpu_busy_ms") is not None else "-"  # runs with --gpu-busy only
    return (f"| {name} | {_label(r)} | {r['fwd_ms']:.2f} | {r['step_ms']:.2f} | {host} | {busy} | {vs} | "
            f"{r['tflops']:.0f} | {r['kept_mb']:.0f} | {r['peak_mb']:.0f} | {err} |")


def results_markdown(rows: list[dict]) -> str:
    out = []
    layer = latest_rows(rows, "layer")
    if layer:  # the GPU of the newest layer run: one GPU's rows in one table
        gpu = max(layer, key=lambda r: r["date"])["gpu"]
        layer = [r for r in layer if r["gpu"] == gpu]
    if layer:
        r0 = layer[0]
        out += [f"One MoE layer, forward+backward, {r0['activation']} {r0['dtype']}, {r0['gpu']}, torch {r0['torch']}, "
                f"triton {r0['triton']}. All rows of a config come from one run: {_runs(layer)}.",
                "`host ms`: the host's time to issue one step (near `step ms`, the host sets the pace: launch cost "
                "or a "
                "synchronization); `GPU busy ms`: the step's kernel times summed (runs with `--gpu-busy`; where the "
                "host paces the step, this compares the kernels alone); `kept MB`: allocated after forward minus the "
                "output (what the layer keeps for backward); "
                "`peak MB`: peak over forward+backward above the pre-forward baseline; `vs sonic`, `vs gmm`: "
                "SonicMoE's and torch_gmm's step time / this one (>1 is faster); `err`: largest relative error of the "
                "output and the gradients against the fp32 reference (runs without `--no-ref`).", "",
                "| config (L,d,h,E,K) | implementation | fwd ms | step ms | host ms | GPU busy ms | vs sonic | vs gmm "
                "| TF/s | kept MB | peak MB | err |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for cfg in sorted(dict.fromkeys(_cfg(r) for r in layer), key=_cfg_order):
            # a run may measure a config more than once: the k-th row of each implementation is repeat k,
            # and each row is compared with SonicMoE's row of the same repeat
            repeats, seen = [], defaultdict(int)
            for r in (r for r in layer if _cfg(r) == cfg):
                repeats.append((seen[_label(r)], r))
                seen[_label(r)] += 1
            sonic = {k: r["step_ms"] for k, r in repeats if r["impl"] == "sonicmoe" and r["status"] == "ok"}
            gmm = {k: r["step_ms"] for k, r in repeats if r["impl"] == "torch_gmm" and r["status"] == "ok"}
            for k, r in repeats:
                name = f"{cfg} (repeat {k + 1})" if max(seen.values()) > 1 else cfg
                out.append(_layer_line(name, r, sonic.get(k), gmm.get(k)))
    disp = latest_rows(rows, "dispatch")
    if disp:
        r0 = disp[0]
        out += ["", f"## Routing index build ({_short_gpu(r0)}, {r0['date'][:10]})", "",
                f"Routing index build, {r0['gpu']}, {_runs(disp)}.", "",
                "| L | E | K | dense ms | sort ms | argsort+bincount+cumsum ms | sort / dense |",
                "|---|---|---|---|---|---|---|"]
        for r in disp:
            m = r.get("dispatch_ms") or {}
            if r["status"] == "ok":
                out.append(f"| {r['L']} | {r['E']} | {r['K']} | {m['dense']:.3f} | {m['sort']:.3f} | "
                           f"{m['argsort_bincount_cumsum']:.3f} | {m['sort'] / m['dense']:.2f} |")
            else:
                out.append(f"| {r['L']} | {r['E']} | {r['K']} | {r['status'][:40]} | | | |")
    scale = latest_rows(rows, "scale")
    if scale:
        r0 = scale[0]
        out += ["", f"## Scaling with the token count ({_short_gpu(r0)}, {r0['date'][:10]})", "",
                f"Scaling, d,h,E,K = {r0['d']},{r0['h']},{r0['E']},{r0['K']}, {r0['gpu']}; {_runs(scale)}.", "",
                "| tokens | implementation | step ms | kept MB | peak MB | KB per token (peak) |",
                "|---|---|---|---|---|---|"]
        for r in sorted(scale, key=lambda r: (_label(r), r["L"])):
            if r["status"] == "ok":
                out.append(f"| {r['L']} | {_label(r)} | {r['step_ms']:.1f} | {r['kept_mb']:.0f} | {r['peak_mb']:.0f} | "
                           f"{r['peak_mb'] * 1024 / r['L']:.1f} |")
            else:
                out.append(f"| {r['L']} | {_label(r)} | {r['status'][:40]} | | | |")
    return "\n".join(out) if out else "No GPU results recorded yet."


def standing_markdown(rows: list[dict]) -> str:
    """The headline run's summary (headline_run): per config, the step time of each headline series with the
    kernels' own time in brackets, and their peaks; the fp8 cell says where the rule ran bf16 (no e4m3 launch)."""
    run = headline_run(rows)
    if not run:
        return "(no run has measured every headline series yet)"

    def row(c, impl, policy):
        return next(r for r in run if _cfg(r) == c and (r["impl"], r["policy"]) == (impl, policy))

    def ms(r):
        busy = f" ({r['gpu_busy_ms']:.2f})" if r.get("gpu_busy_ms") is not None else ""
        return f"{r['step_ms']:.2f}{busy}"

    from moeblaze.bench.names import CONFIGS

    names = {",".join(map(str, v)): k for k, v in CONFIGS.items()}
    r0 = run[0]
    out = [f"One run, every implementation in the same process: {r0['gpu']}, torch {r0['torch']}, triton "
           f"{r0['triton']}, {_runs(run)}; all columns in [results](results.md). Step time (CUDA-event median, in "
           "turns) with the kernels' own time (`GPU busy`) in brackets, and the step's peak memory above its inputs.",
           "", "| config | moeblaze bf16 ms | SonicMoE ms | torch grouped_mm ms | moeblaze `precision=\"fp8\"` ms | "
           "peak MB: moeblaze / SonicMoE / grouped_mm / fp8 |", "|---|---|---|---|---|---|"]
    for c in sorted({_cfg(r) for r in run}, key=_cfg_order):
        ours, sonic, gmm, fp8 = (row(c, "moeblaze", "preact"), row(c, "sonicmoe", "-"), row(c, "torch_gmm", "-"),
                                 row(c, "moeblaze-fp8", "preact"))
        e4m3 = any(x.startswith("fp8_rows") for x in fp8.get("launches") or [])
        fp8_cell = ms(fp8) if e4m3 else f"{fp8['step_ms']:.2f} (bf16 by the rule)"
        out.append(f"| {names.get(c, c)} | {ms(ours)} | {ms(sonic)} | {ms(gmm)} | {fp8_cell} | "
                   f"{ours['peak_mb']:.0f} / {sonic['peak_mb']:.0f} / {gmm['peak_mb']:.0f} / {fp8['peak_mb']:.0f} |")
    return "\n".join(out)


SECTIONS = {"results": results_markdown, "standing": standing_markdown}  # a page's generated sections, by marker


def _markers(name: str) -> tuple[str, str]:
    """A generated section's start and end markers."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def update_report(report: str, results_dir: str) -> None:
    """Rewrite the generated sections of a docs page (between their markers: SECTIONS), and the charts the results
    page shows, from the results folder."""
    rows = load_rows(results_dir)
    text = open(report).read()
    found = [name for name in SECTIONS if all(m in text for m in _markers(name))]
    if not found:
        raise SystemExit(f"{report} has no generated section (<!-- NAME:start --> ... <!-- NAME:end -->, NAME one "
                         f"of {', '.join(SECTIONS)})")
    if "results" in found:
        if headline := plot_headline(rows, os.path.join(results_dir, "headline.png")):
            print(f"plot: {headline}")
        for gpu in sorted({r["gpu"] for r in rows if r.get("gpu") != "cpu"}):
            sel = latest_rows([r for r in rows if r["gpu"] == gpu], "scale")  # the layer rows' chart: the headline
            if sel:
                print(f"plot: {plot_run(sel, results_dir, name=f'{slug(gpu)}-scale')[0]}")
    for name in found:
        start, end = _markers(name)
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + start + "\n" + SECTIONS[name](rows) + "\n" + end + tail  # all computed before the write
    with open(report, "w") as f:
        f.write(text)
    print(f"updated the generated {', '.join(found)} of {report}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="the folder of moeblaze bench's rows (its --out)")
    ap.add_argument("--plot", action="store_true", help="PNG charts of the latest run's rows, beside them")
    ap.add_argument("--report", metavar="PAGE", action="append", default=[],
                    help="regenerate a docs page's generated sections (between their markers) and the charts the "
                         "results page shows; repeatable")
    args = ap.parse_args(argv)
    if not (args.plot or args.report):
        ap.error("say --plot, --report FILE or both")
    if args.plot:
        rows = load_rows(args.results)
        run_id = max(rows, key=lambda r: r["date"])["run_id"] if rows else None  # the newest run, any GPU's file
        for path in plot_run([r for r in rows if r.get("run_id") == run_id], args.results):
            print(f"plot: {path}")
    for page in args.report:
        update_report(page, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
