"""Training comparisons on the GPU: moeblaze train on the same tokens, several seeds per variant, then each
variant's validation loss against the study's baseline and its curves.

  --study routing  plain top-k (the baseline) and SonicMoE's token rounding (nr-f), under softmax + switch loss
                   (the default router) and under sigmoid + expert-bias balancing (DeepSeek-V3's router, with its
                   1e-4 sequence loss); the max/mean expert load over training
  --study fp8      bf16 (the baseline), precision="fp8" (the experts' data GEMMs on e4m3 at every size:
                   fp8_min_rows=0) and checkpoint="preact-fp8";
                   whether each ends inside the baseline's seed band, and the late relative gap of the training
                   loss (its mean over the last 10% of steps against the baseline's); the gradient norm over training
  --study wire     expert parallelism over 2 GPUs (torchrun, --ep 2) under precision="fp8": the tokens' rows crossing
                   in bf16 (the baseline) and as e4m3 with their scales (--ep-wire e4m3: the receiver's experts and
                   their weight gradients see the quantized rows); also bf16 without and with the e4m3 wire

    python scripts/train_compare.py run [--study routing] [--out DIR] [--seeds 0,1,2] [--jobs 6] [--steps N]  (GPU)
                                        [--shapes small] [--variants top-k,rounding] [--cpu]
                                        (--cpu: a proxy in fp32 on the reference)
    python scripts/train_compare.py report DIR [--study routing] [--png FILE]                                 (anywhere)

Shapes, routing: "small" (moeblaze train's default: 8 experts, top-2, 2048 tokens a step: 4 tiles of 128 pairs per
expert on average) and "small-64e" (64 experts, top-4, width 64, 4096 tokens a step: 2 tiles, the fewest the
rounding is meant for). fp8: "small" and "medium" (d 512, 4 layers, 16 experts of width 512). run writes
DIR/<shape>/<variant>-s<seed>.jsonl (moeblaze train --loss-log: the loss, the gradient norm and each layer's
max/mean load per step, then the validation losses); each shape trains its own number of steps (STEPS; --steps
sets one for all): the small model 3000, past the sharp drop of its loss between steps ~400 and ~700, whose timing
moves with noise (at 1000 steps its seed spread is larger than the effects measured); report prints a table (mean
and spread over seeds), writes it as DIR/summary.json, and plots the training loss and the load or the gradient norm
(seed means) to --png.
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

STUDIES = {
    "routing": dict(
        baseline="top-k",
        shapes={"small": [], "small-64e": ["--num-experts", "64", "--top-k", "4", "--d-expert", "64", "--batch-size",
                                          "32"]},
        variants={
            "top-k": [],
            "rounding": ["--token-rounding", "nr-f"],
            "sigmoid-bias": ["--router", "deepseek-v3", "--aux-loss-coef", "1e-4"],
            "sigmoid-bias-rounding": ["--router", "deepseek-v3", "--aux-loss-coef", "1e-4", "--token-rounding",
                                      "nr-f"],
        },
        curve=("load_max_mean", "max / mean expert load (layer mean)")),
    "fp8": dict(
        baseline="bf16",
        shapes={"small": [], "medium": ["--d-model", "512", "--n-heads", "8", "--n-layers", "4", "--num-experts",
                                        "16", "--d-expert", "512"]},
        variants={"bf16": [], "fp8": ["--precision", "fp8", "--fp8-min-rows", "0"],
                  "preact-fp8": ["--checkpoint-policy", "preact-fp8"]},
        curve=("grad_norm", "gradient norm before clipping")),
    "wire": dict(
        baseline="fp8",
        launch=["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
        shapes={"small": ["--ep", "2"]},
        variants={"fp8": ["--precision", "fp8", "--fp8-min-rows", "0"],
                  "fp8-e4m3-wire": ["--precision", "fp8", "--fp8-min-rows", "0", "--ep-wire", "e4m3"],
                  "bf16": [], "bf16-e4m3-wire": ["--ep-wire", "e4m3"]},
        curve=("grad_norm", "gradient norm before clipping")),
}


STEPS = {"small": 3000}  # other shapes: 1000


def run(args) -> int:
    study, jobs = STUDIES[args.study], []
    if args.cpu and "launch" in study:
        raise SystemExit(f"--study {args.study} runs under torchrun on GPUs: it has no --cpu proxy")
    device = ["--device", "cpu", "--dtype", "float32", "--impl", "reference"] if args.cpu else ["--dtype", "bfloat16"]
    for shape, shape_args in study["shapes"].items():
        if args.shapes and shape not in args.shapes.split(","):
            continue
        os.makedirs(os.path.join(args.out, shape), exist_ok=True)
        for variant, variant_args in study["variants"].items():
            if args.variants and variant not in args.variants.split(","):
                continue
            for seed in args.seeds.split(","):
                log = os.path.join(args.out, shape, f"{variant}-s{seed}.jsonl")
                steps = args.steps or STEPS.get(shape, 1000)
                jobs.append([sys.executable, *study.get("launch", []), "-m", "moeblaze.cli", "train",
                             "--steps", str(steps), "--seed", seed,
                             *device, "--save", "", "--loss-log", log, *shape_args, *variant_args])

    def one(cmd):
        p = subprocess.run(cmd, capture_output=True, text=True)
        tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
        said = " ".join(cmd[cmd.index("train") + 1:])
        print(("ok  " if p.returncode == 0 else f"rc {p.returncode} ") + said + "\n    " + tail[0], flush=True)
        return p.returncode

    if not args.cpu:  # compile the kernels once, before the jobs share the cache
        subprocess.run([sys.executable, "-m", "moeblaze.cli", "train", "--steps", "2", "--save", "", "--dtype",
                        "bfloat16"], capture_output=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        return max(pool.map(one, jobs))


def _read(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    steps = [r for r in rows if "loss" in r]
    return steps, [r for r in rows if "val_loss" in r]


def _mean(rows, key):
    return statistics.mean(statistics.mean(r[key]) if isinstance(r[key], list) else r[key] for r in rows)


def report(args) -> None:
    study, summary = STUDIES[args.study], {}
    for shape in study["shapes"]:
        runs = {}
        for path in sorted(glob.glob(os.path.join(args.dir, shape, "*.jsonl"))):
            variant, seed = os.path.basename(path)[:-6].rsplit("-s", 1)
            runs.setdefault(variant, {})[seed] = _read(path)
        if study["baseline"] not in runs:
            continue
        base_runs = runs[study["baseline"]].values()
        base_finals = [v[-1]["val_loss"] for _, v in base_runs]
        base = statistics.mean(base_finals)
        base_late = statistics.mean(_mean(s[-len(s) // 10:], "loss") for s, _ in base_runs)
        key, _ = study["curve"]
        summary[shape] = {}
        print(f"\n{shape}: final validation loss (nats/byte, mean over seeds) against {study['baseline']}; inside "
              f"its seed band [{min(base_finals):.4f}, {max(base_finals):.4f}]; late gap (training loss over the "
              f"last 10% of steps); {key} over all steps and over the last 10%")
        for variant, seeds in runs.items():
            finals = [v[-1]["val_loss"] for _, v in seeds.values()]
            late = statistics.mean(_mean(s[-len(s) // 10:], "loss") for s, _ in seeds.values())
            row = dict(seeds=len(finals), val_loss=round(statistics.mean(finals), 5),
                       val_loss_spread=round(max(finals) - min(finals), 5),
                       vs_baseline=round(statistics.mean(finals) / base - 1, 5),
                       in_band=min(base_finals) <= statistics.mean(finals) <= max(base_finals),
                       late_gap=round(late / base_late - 1, 5),
                       **{key: round(_mean([r for s, _ in seeds.values() for r in s], key), 3),
                          key + "_last10": round(_mean([r for s, _ in seeds.values() for r in s[-len(s) // 10:]],
                                                       key), 3)})
            summary[shape][variant] = row
            print(f"  {variant:24s} {row['val_loss']:.4f} (spread {row['val_loss_spread']:.4f}, "
                  f"{row['vs_baseline']:+.2%}, {'inside' if row['in_band'] else 'outside'} the band) late gap "
                  f"{row['late_gap']:+.3%}; {key} {row[key]:.3f} (last 10%: {row[key + '_last10']:.3f})")
    with open(os.path.join(args.dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if args.png:
        _plot(args.dir, args.png, study)


def _plot(folder, png, study):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, label = study["curve"]
    shapes = [s for s in study["shapes"] if glob.glob(os.path.join(folder, s, "*.jsonl"))]  # the shapes run here
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 7), squeeze=False)
    for col, shape in enumerate(shapes):
        for variant in study["variants"]:
            paths = sorted(glob.glob(os.path.join(folder, shape, f"{variant}-s*.jsonl")))
            if not paths:
                continue
            runs = [_read(p)[0] for p in paths]
            n = min(len(r) for r in runs)
            steps = [r["step"] for r in runs[0][:n]]
            loss = [statistics.mean(r[i]["loss"] for r in runs) for i in range(n)]
            curve = [_mean([r[i] for r in runs], key) for i in range(n)]
            skip = n // 10  # the loss from 10% of the steps on, where the curves part
            axes[0][col].plot(steps[skip:], _smooth(loss)[skip:], label=variant, lw=1.2)
            axes[1][col].plot(steps, _smooth(curve), label=variant, lw=1.2)
        axes[0][col].set_title(shape)
        axes[0][col].set_ylabel("training loss (nats/byte, seed mean, smoothed)")
        axes[1][col].set_ylabel(label)
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
    r.add_argument("--study", default="routing", choices=tuple(STUDIES))
    r.add_argument("--out", default="out/train-compare")
    r.add_argument("--seeds", default="0,1,2")
    r.add_argument("--jobs", type=int, default=6)
    r.add_argument("--steps", type=int, default=0, help="steps for every shape (default: STEPS per shape)")
    r.add_argument("--shapes", default="", help="a comma-separated subset of the study's shapes")
    r.add_argument("--variants", default="", help="a comma-separated subset of the study's variants")
    r.add_argument("--cpu", action="store_true", help="a CPU proxy: float32, the PyTorch reference (the fp8 study: "
                   "its emulation), not the GPU's bf16 kernels")
    p = sub.add_parser("report")
    p.add_argument("dir")
    p.add_argument("--study", default="routing", choices=tuple(STUDIES))
    p.add_argument("--png", default="")
    args = ap.parse_args()
    if args.cmd == "run":
        raise SystemExit(run(args))
    report(args)


if __name__ == "__main__":
    main()
