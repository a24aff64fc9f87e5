"""Routing quality on the GPU: the small model trained on the same tokens with plain top-k and SonicMoE's token
rounding (nr-f), under softmax + switch loss (the default router) and under sigmoid + expert-bias balancing
(DeepSeek-V3's router, with its 1e-4 sequence loss), several seeds; then the validation loss of each against
plain top-k, and the max/mean expert load over training.

    python scripts/routing_quality.py run [--out DIR] [--seeds 0,1,2] [--jobs 6] [--steps 1000]   (GPU)
    python scripts/routing_quality.py report DIR [--png FILE]                                  (anywhere)

Two shapes: "small" (moeblaze train's default: 8 experts, top-2, 2048 tokens a step: 4 tiles of 128 pairs per
expert on average) and "small-64e" (64 experts, top-4, width 64, 4096 tokens a step: 2 tiles, the fewest the
rounding is meant for). run writes DIR/<shape>/<variant>-s<seed>.jsonl (moeblaze train --loss-log: the loss and
each layer's max/mean load per step, then the validation losses); report prints a table (mean and spread over
seeds) and writes it as DIR/summary.json, and plots the training loss and the load (seed means) to --png.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

SHAPES = {"small": [], "small-64e": ["--num-experts", "64", "--top-k", "4", "--d-expert", "64", "--batch-size", "32"]}
VARIANTS = {
    "top-k": [],
    "rounding": ["--token-rounding", "nr-f"],
    "sigmoid-bias": ["--router", "deepseek-v3", "--aux-loss-coef", "1e-4"],
    "sigmoid-bias-rounding": ["--router", "deepseek-v3", "--aux-loss-coef", "1e-4", "--token-rounding", "nr-f"],
}


def run(args) -> int:
    jobs = []
    for shape, shape_args in SHAPES.items():
        os.makedirs(os.path.join(args.out, shape), exist_ok=True)
        for variant, variant_args in VARIANTS.items():
            for seed in args.seeds.split(","):
                log = os.path.join(args.out, shape, f"{variant}-s{seed}.jsonl")
                jobs.append([sys.executable, "-m", "moeblaze.cli", "train", "--steps", str(args.steps), "--seed", seed,
                             "--dtype", "bfloat16", "--save", "", "--loss-log", log, *shape_args, *variant_args])

    def one(cmd):
        p = subprocess.run(cmd, capture_output=True, text=True)
        tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
        print(("ok  " if p.returncode == 0 else f"rc {p.returncode} ") + " ".join(cmd[3:]) + "\n    " + tail[0],
              flush=True)
        return p.returncode

    subprocess.run([sys.executable, "-m", "moeblaze.cli", "train", "--steps", "2", "--save", "", "--dtype",
                    "bfloat16"], capture_output=True)  # compile the kernels once, before the jobs share the cache
    with ThreadPoolExecutor(args.jobs) as pool:
        return max(pool.map(one, jobs))


def _read(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    steps = [r for r in rows if "loss" in r]
    return steps, [r for r in rows if "val_loss" in r]


def report(args) -> None:
    summary = {}
    for shape in SHAPES:
        runs = {}
        for path in sorted(glob.glob(os.path.join(args.dir, shape, "*.jsonl"))):
            variant, seed = os.path.basename(path)[:-6].rsplit("-s", 1)
            runs.setdefault(variant, {})[seed] = _read(path)
        if not runs:
            continue
        base = statistics.mean(v[-1]["val_loss"] for _, v in runs["top-k"].values())
        summary[shape] = {}
        print(f"\n{shape}: final validation loss (nats/byte, mean over seeds), against plain top-k; max/mean expert "
              "load (mean over layers), over all steps and over the last 10%")
        for variant, seeds in runs.items():
            finals = [v[-1]["val_loss"] for _, v in seeds.values()]
            imb = [statistics.mean(r["load_max_mean"]) for s, _ in seeds.values() for r in s]
            last = [statistics.mean(r["load_max_mean"]) for s, _ in seeds.values() for r in s[-len(s) // 10:]]
            row = dict(seeds=len(finals), val_loss=round(statistics.mean(finals), 5),
                       val_loss_spread=round(max(finals) - min(finals), 5),
                       vs_topk=round(statistics.mean(finals) / base - 1, 5),
                       load_max_mean=round(statistics.mean(imb), 3),
                       load_max_mean_last10=round(statistics.mean(last), 3))
            summary[shape][variant] = row
            print(f"  {variant:24s} {row['val_loss']:.4f} (spread {row['val_loss_spread']:.4f}, "
                  f"{row['vs_topk']:+.2%}) load max/mean {row['load_max_mean']:.2f} "
                  f"(last 10%: {row['load_max_mean_last10']:.2f})")
    with open(os.path.join(args.dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if args.png:
        _plot(args.dir, args.png)


def _plot(folder, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(SHAPES), figsize=(6 * len(SHAPES), 7), squeeze=False)
    for col, shape in enumerate(SHAPES):
        for variant in VARIANTS:
            paths = sorted(glob.glob(os.path.join(folder, shape, f"{variant}-s*.jsonl")))
            if not paths:
                continue
            runs = [_read(p)[0] for p in paths]
            n = min(len(r) for r in runs)
            steps = [r["step"] for r in runs[0][:n]]
            loss = [statistics.mean(r[i]["loss"] for r in runs) for i in range(n)]
            load = [statistics.mean(statistics.mean(r[i]["load_max_mean"]) for r in runs) for i in range(n)]
            skip = n // 10  # the loss from 10% of the steps on, where the curves part
            axes[0][col].plot(steps[skip:], _smooth(loss)[skip:], label=variant, lw=1.2)
            axes[1][col].plot(steps, _smooth(load), label=variant, lw=1.2)
        axes[0][col].set_title(shape)
        axes[0][col].set_ylabel("training loss (nats/byte, seed mean, smoothed)")
        axes[1][col].set_ylabel("max / mean expert load (layer mean)")
        axes[1][col].set_xlabel("step")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def _smooth(ys, a=0.95):
    out, m = [], ys[0]
    for y in ys:
        m = a * m + (1 - a) * y
        out.append(m)
    return out


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", default="out/routing-quality")
    r.add_argument("--seeds", default="0,1,2")
    r.add_argument("--jobs", type=int, default=6)
    r.add_argument("--steps", type=int, default=1000)
    p = sub.add_parser("report")
    p.add_argument("dir")
    p.add_argument("--png", default="")
    args = ap.parse_args()
    if args.cmd == "run":
        raise SystemExit(run(args))
    report(args)


if __name__ == "__main__":
    main()
