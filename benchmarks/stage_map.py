"""The stage map: every kernel of one SwiGLU MoE layer's training step, moeblaze and SonicMoE in one process, each
stage's GPU time against what the GPU allows, measured in the same run.

    python benchmarks/stage_map.py run --configs B,C,D,E --impls moeblaze,sonicmoe,moeblaze-fp8 --out DIR
    python benchmarks/stage_map.py report benchmarks/results/nvidia-h100-stages.jsonl

`run` (on a GPU) appends one row per (config, impl) to DIR/<gpu>-stages.jsonl. `report` turns a results file into
the stage table of docs/performance.md (between its markers) and a plot beside the results file: each stage's share
of its limit, both libraries.

How a kernel gets its stage: the Python functions that issue each stage (moeblaze's GEMM strategy and stages,
SonicMoE's functional pieces) are wrapped in profiler ranges here, and each kernel is given the innermost range
around the host call that launched it (the trace's correlation ids). Nothing in either library changes.

The limits, both measured in the run: the dense bf16 MMA rate (torch.mm of two 8192² bf16 matrices) and the HBM
bandwidth (a 2 GiB device copy, bytes read plus written). A stage's floor is max(FLOPs / MMA rate, fewest bytes /
bandwidth); its share of the limit is floor / measured time. FLOPs per stage (R = L·K rows): up 4·R·d·h, down
2·R·h·d, down_bwd 2·R·d·h, dW2 2·R·d·h, dW1 4·R·h·d, dX~ 4·R·h·d (18·L·K·d·h in all). Fewest bytes: each input
read once and each output written once (bf16 operands, fp32 router weights), as stage_bytes lists them.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shlex
import sys
from collections import defaultdict

STAGES = ("index", "up", "down", "combine", "down_bwd", "dW2", "dW1", "dX~", "dx", "quant", "other")
GEMM_FLOPS = {"up": 4, "down": 2, "down_bwd": 2, "dW2": 2, "dW1": 4, "dX~": 4}  # × R·d·h
FP8_GEMMS = ("up", "down", "down_bwd", "dX~")  # on e4m3 under precision="fp8"


def stage_bytes(stage: str, L: int, d: int, h: int, E: int, K: int, b: int = 2) -> float:
    """The fewest bytes a stage must move: each input once, each output once."""
    R = L * K
    return {
        "index": 4 * L * K + 4 * (2 * R + E + 1),
        "up": b * (L * d + E * 2 * h * d + R * 2 * h + R * h),  # x, W1 -> preact (kept), A
        "down": b * (R * h + E * d * h + R * d),  # A, W2 -> Y
        "combine": b * (R * d + L * d) + 4 * R,  # Y, weights -> out
        "down_bwd": b * (L * d + E * d * h + R * 2 * h + R * 2 * h + R * h) + 8 * R,  # dy, W2, preact -> dH, s·A, dS
        "dW2": b * (L * d + R * h + E * d * h),  # dy, s·A -> dW2
        "dW1": b * (R * 2 * h + L * d + E * 2 * h * d),  # dH, x -> dW1
        "dX~": b * (R * 2 * h + E * 2 * h * d + R * d),  # dH, W1 -> dX~
        "dx": b * (R * d + L * d),  # dX~ -> dx
    }.get(stage, 0.0)


# ---- labelling: profiler ranges around the functions that issue each stage ----------------------------------

def _ranged(fn, label):
    """fn inside a profiler range named `stage:<label>` (label a string, or a function of fn's args)."""
    import torch

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        name = label if isinstance(label, str) else label(*args, **kwargs)
        with torch.profiler.record_function("stage:" + name):
            return fn(*args, **kwargs)
    return wrapper


def _wrap(obj, attr, label):
    setattr(obj, attr, _ranged(getattr(obj, attr), label))


def label_moeblaze() -> None:
    from moeblaze.bench import harness
    from moeblaze.experts import fp8, op, stages
    from moeblaze.experts import quant

    _wrap(harness, "build_routing_index", "index")
    _wrap(stages.RowPlan, "build", "index")  # the tile schedule
    for cls in (op.NativeGemms, fp8.Fp8Gemms):
        _wrap(cls, "up", "up")
        _wrap(cls, "preact", "up")
        _wrap(cls, "down", "down")
        _wrap(cls, "dact", "down_bwd")
        _wrap(cls, "dx_rows", "dX~")
    _wrap(stages, "combine", lambda plan, y, w, *a, **k: "dx" if w is None else "combine")
    _wrap(stages, "weight_grad", lambda plan, p, q, out, gathered_p, *a, **k: "dW2" if gathered_p else "dW1")
    for mod in {id(m): m for m in (quant, fp8.quant, op)}.values():
        for name in ("quantize_rows", "quantize_blocks", "swiglu_quantize"):
            if hasattr(mod, name):
                _wrap(mod, name, "quant")


def label_sonicmoe() -> None:
    import sonicmoe.functional as f

    for attr, stage in (("general_routing_router_metadata_triton", "index"), ("_up_projection_forward", "up"),
                        ("_down_projection_forward", "down"), ("_router_forward", "combine"),
                        ("_down_projection_backward_act", "down_bwd"), ("_down_projection_backward_weight", "dW2"),
                        ("_up_projection_backward_weight", "dW1"), ("_up_projection_backward_act", "dX~"),
                        ("_token_broadcast_backward", "dx")):
        _wrap(f, attr, stage)


def labelled_kernels(trace_path: str) -> list[tuple[str, str, float, float]]:
    """[(stage, kernel, start µs, duration µs)] of a chrome trace: each kernel labelled by the innermost
    `stage:` range around the host call that launched it (matched by correlation id), else "other"."""
    with open(trace_path) as fh:
        events = json.load(fh)["traceEvents"]
    ranges = defaultdict(list)  # tid -> [(start, end, stage)]
    launches = {}  # correlation -> (tid, ts)
    kernels = []
    for ev in events:
        cat, args = ev.get("cat", ""), ev.get("args", {})
        if cat == "user_annotation" and ev.get("name", "").startswith("stage:"):
            ranges[ev["tid"]].append((ev["ts"], ev["ts"] + ev["dur"], ev["name"][6:]))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launches[args["correlation"]] = (ev["tid"], ev["ts"])
        elif cat == "kernel":
            kernels.append((ev["name"], ev["ts"], ev["dur"], args.get("correlation")))
    out = []
    for name, ts, dur, corr in kernels:
        stage = "other"
        if corr in launches:
            tid, t = launches[corr]
            inside = [(b - a, s) for a, b, s in ranges.get(tid, ()) if a <= t <= b]
            if inside:
                stage = min(inside)[1]
        out.append((stage, name, ts, dur))
    return sorted(out, key=lambda k: k[2])


def profile_stages(step, steps: int) -> dict:
    """{stage: [(kernel, GPU ms per step)], longest first}: the kernels of `steps` steps of step(i), summed by
    name within each stage and divided by `steps`."""
    from moeblaze.bench.harness import profile_trace

    def run():
        for i in range(steps):
            step(i)

    names = defaultdict(lambda: defaultdict(float))
    for stage, name, _, dur in profile_trace(run, labelled_kernels, cpu=True):
        names[stage][name] += dur / 1e3 / steps
    return {st: sorted(v.items(), key=lambda kv: -kv[1]) for st, v in names.items()}


def stage_ms(row: dict) -> dict:
    """{stage: GPU ms per step} of a result row."""
    return {s: sum(ms for _, ms in row["kernels"].get(s, ())) for s in STAGES}


# ---- the limits ------------------------------------------------------------------------------------------------

def measure_roofs() -> dict:
    import torch
    from moeblaze.bench.harness import timed_rounds

    dev = torch.device("cuda")

    def median_ms(fn):
        return timed_rounds({0: lambda i: fn()}, dev, 10)[0][0]

    n = 8192
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    mm = median_ms(lambda: a @ b)
    src = torch.randn(2 ** 30, device=dev, dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    cp = median_ms(lambda: dst.copy_(src))
    roofs = {"mma_tflops": 2 * n ** 3 / mm / 1e9, "hbm_gbs": 2 * src.nbytes / cp / 1e6}
    if torch.cuda.get_device_capability() >= (8, 9):
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        mm8 = median_ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        roofs["fp8_mma_tflops"] = 2 * n ** 3 / mm8 / 1e9
    return roofs


# ---- run ---------------------------------------------------------------------------------------------------------

def run(args) -> None:
    import torch
    import triton
    from moeblaze.bench import harness
    from moeblaze.bench.names import CONFIGS

    dev_name = torch.cuda.get_device_name()
    slug = "nvidia-h200" if "H200" in dev_name else "nvidia-h100" if "H100" in dev_name else "gpu"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{slug}-stages.jsonl")
    impls = args.impls.split(",")
    label_moeblaze()
    if "sonicmoe" in impls:
        label_sonicmoe()
    from moeblaze.cli.bench import run_env  # the commit and the command as the bench records them

    env = run_env(torch.device("cuda"), "python " + shlex.join(sys.argv))
    meta = dict(gpu=dev_name, torch=torch.__version__, triton=triton.__version__, sha=env["git_sha"],
                date=datetime.date.today().isoformat(), command=env["command"])
    if "sonicmoe" in impls:
        import importlib.metadata as md
        meta["sonicmoe"] = md.version("sonic-moe")
    roofs = measure_roofs()
    print(dev_name, roofs, flush=True)
    for cfg in args.configs.split(","):
        L, d, h, E, K = CONFIGS[cfg]
        p = harness.make_problem(L, d, h, E, K)
        calls, prep = {}, {}
        for impl in impls:
            call = harness.IMPLS[impl][2](p, "preact" if impl.startswith("moeblaze") else "-")
            try:
                prep[impl] = harness.prepare(call, p)
                calls[impl] = call
                print(f"{cfg} {impl}: compiled and warm", flush=True)
            except Exception as e:  # one impl failing (out of memory, a compile error) leaves the others
                print(f"{cfg} {impl}: {type(e).__name__}: {e}", flush=True)
        times = harness.time_interleaved(calls, p, iters=10)
        for impl, call in calls.items():
            if isinstance(times[impl], Exception):
                print(f"{cfg} {impl}: {times[impl]!r}", flush=True)
                continue
            st = profile_stages(lambda i, c=call, p=p: harness.run_step(c, p, i, True), args.steps)
            row = dict(meta, config=cfg, shape=[L, d, h, E, K], impl=impl, roofs=roofs,
                       step_ms=times[impl]["step_ms"], fwd_ms=times[impl]["fwd_ms"],
                       kept_mb=prep[impl].get("kept_mb"), peak_mb=prep[impl].get("peak_mb"),
                       kernels=st)
            with open(path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(f"{cfg} {impl}: step {row['step_ms']:.2f} ms, kept {row['kept_mb']:.0f} MB; " + ", ".join(
                f"{s} {ms:.2f}" for s, ms in stage_ms(row).items() if ms), flush=True)
        del p, calls
        torch.cuda.empty_cache()
    print(report_table([json.loads(x) for x in open(path)]))


# ---- report ------------------------------------------------------------------------------------------------------

def stage_metrics(row: dict) -> dict:
    """{stage: (ms, TF/s or None, GB/s, share of its floor)} of one result row."""
    L, d, h, E, K = row["shape"]
    hbm = row["roofs"]["hbm_gbs"] * 1e9
    out, times = {}, stage_ms(row)
    # the e4m3 GEMMs of precision="fp8" against the e4m3 rate (the weight gradients stay in bf16), where the step
    # ran e4m3: a step the fp8_min_rows rule ran in native precision has no quantizer and is held to the bf16 rate
    e4m3 = "fp8" in row["impl"] and times.get("quant", 0) > 0
    for s, ms in times.items():
        if ms <= 0:
            continue
        fp8 = e4m3 and s in FP8_GEMMS
        mma = row["roofs"].get("fp8_mma_tflops" if fp8 else "mma_tflops", float("inf")) * 1e12  # inf: not measured
        flops = GEMM_FLOPS.get(s, 0) * L * K * d * h
        nbytes = stage_bytes(s, L, d, h, E, K)
        floor_s = max(flops / mma, nbytes / hbm)
        out[s] = (ms, flops / ms / 1e9 if flops else None, nbytes / ms / 1e6, floor_s * 1e3 / ms if floor_s else None)
    return out


def latest(rows: list[dict]) -> list[dict]:
    """The newest row of each (config, impl) on each GPU."""
    keep = {}
    for r in rows:
        keep[(r["gpu"], r["config"], r["impl"])] = r
    return list(keep.values())


def report_table(rows: list[dict]) -> str:
    rows = latest(rows)
    lines = []
    for gpu in sorted({r["gpu"] for r in rows}):
        for cfg in sorted({r["config"] for r in rows if r["gpu"] == gpu}):
            rs = sorted((r for r in rows if r["gpu"] == gpu and r["config"] == cfg), key=lambda r: r["impl"])
            r0 = rs[0]
            L, d, h, E, K = r0["shape"]
            lines += [f"**{cfg}** (L {L}, d {d}, h {h}, E {E}, K {K}) on {gpu}: dense bf16 mm "
                      f"{r0['roofs']['mma_tflops']:.0f} TF/s, copy {r0['roofs']['hbm_gbs']:.0f} GB/s; "
                      + "; ".join(f"{r['impl']} step {r['step_ms']:.2f} ms, kept {r['kept_mb']:.0f} MB" for r in rs),
                      "", "| stage | " + " | ".join(f"{r['impl']} ms | TF/s or GB/s | of limit" for r in rs) + " |",
                      "|---|" + "---|---|---|" * len(rs)]
            metrics = [stage_metrics(r) for r in rs]
            for s in STAGES:
                if not any(s in m for m in metrics):
                    continue
                cells = []
                for m in metrics:
                    if s not in m:
                        cells.append("- | - | -")
                        continue
                    ms, tf, gbs, frac = m[s]
                    rate = f"{tf:.0f} TF/s" if tf else f"{gbs:.0f} GB/s" if gbs else "-"
                    cells.append(f"{ms:.3f} | {rate} | " + (f"{frac:.0%}" if frac else "-"))
                lines.append(f"| {s} | " + " | ".join(cells) + " |")
            sums = [sum(m[s][0] for s in m) for m in metrics]
            lines += ["| kernels, summed | " + " | ".join(f"{t:.3f} | | " for t in sums) + " |", ""]
    return "\n".join(lines)


def plot(rows: list[dict], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in latest(rows) if r["impl"] in ("moeblaze", "sonicmoe")]
    cfgs = sorted({r["config"] for r in rows})
    gemm = [s for s in STAGES if s in GEMM_FLOPS or s in ("combine", "dx")]
    fig, axes = plt.subplots(1, len(cfgs), figsize=(4.2 * len(cfgs), 3.6), sharey=True, squeeze=False)
    for ax, cfg in zip(axes[0], cfgs):
        for j, impl in enumerate(("moeblaze", "sonicmoe")):
            r = next((r for r in rows if r["config"] == cfg and r["impl"] == impl), None)
            if r is None:
                continue
            m = stage_metrics(r)
            ax.bar([i + 0.4 * j for i in range(len(gemm))], [m.get(s, (0, 0, 0, 0))[3] or 0 for s in gemm], 0.4,
                   label=f"{impl} ({r['step_ms']:.1f} ms)")
        ax.set_xticks([i + 0.2 for i in range(len(gemm))], gemm, rotation=45)
        ax.set_title(cfg)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("share of the stage's limit")
    fig.suptitle(f"each stage's time against its floor, {rows[0]['gpu']}" if rows else "")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


BEGIN, END = "<!-- stage table: generated by benchmarks/stage_map.py report -->", "<!-- end of stage table -->"


def report(args) -> None:
    rows = [json.loads(x) for x in open(args.results)]
    table = report_table(rows)
    doc = open(args.doc).read()
    a, b = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    with open(args.doc, "w") as fh:
        fh.write(doc[:a] + "\n" + table + "\n" + doc[b:])
    plot(rows, args.results.removesuffix(".jsonl") + ".png")
    print(table)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure (GPU)")
    r.add_argument("--configs", default="B,C,D,E")
    r.add_argument("--impls", default="moeblaze,sonicmoe")
    r.add_argument("--steps", type=int, default=5, help="profiled steps per impl")
    r.add_argument("--out", default="benchmarks/results")
    p = sub.add_parser("report", help="the docs table and plot from a results file")
    p.add_argument("results")
    p.add_argument("--doc", default="docs/performance.md")
    args = ap.parse_args(argv)
    (run if args.cmd == "run" else report)(args)


if __name__ == "__main__":
    main()
