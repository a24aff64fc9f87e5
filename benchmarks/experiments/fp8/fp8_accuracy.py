"""Lab notebook, 2026-11-23. Question: how large is the e4m3 recipe's own error, per GEMM and for a layer, before any
kernel?
Answer: 3.7% relative L2 per GEMM at K = 1k to 16k (2.7% with 100x outliers in 0.1% of the channels); a layer with
its four data GEMMs in e4m3 5.3-6.5% on the output and every gradient; preact-fp8 alone leaves the output exact and
the gradients at 2.9-4.0% (docs/results.md).

The e4m3 recipe's error, emulated (moeblaze.reference.fp8, fp32 accumulation), against fp32 from the same bf16
inputs: what any fp8 kernel's error is measured against. Runs anywhere (CPU by default).

  gemm   activation rows (1 x 128 scales) times a weight (128 x 128 blocks), K = 1024, 4096, 16384, with clean
         inputs, 100x outliers in 0.1% of the channels (at least one), and 10% zero rows
  layer  moeblaze.reference.moe_experts_reference with ExpertsConfig(precision="fp8"), (checkpoint="preact-fp8")
         and both against the fp32 layer: output and every gradient

    python benchmarks/experiments/fp8/fp8_accuracy.py [--out DIR] [--device cpu]

Metrics: relative L2 error, cosine similarity, and DeepGEMM's calc_diff = 1 - 2 Σxy / Σ(x² + y²). One JSON row each
in DIR/fp8_accuracy.jsonl, and a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch

from moeblaze import ExpertsConfig
from moeblaze.cli.bench import run_env
from moeblaze.reference import fake_quant_blocks, fake_quant_rows, moe_experts_reference
from moeblaze.routing import route_topk


def metrics(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return dict(rel_l2=float((a - b).norm() / b.norm()), cosine=float(a @ b / (a.norm() * b.norm())),
                calc_diff=float(1 - 2 * (a @ b) / (a @ a + b @ b)))


def gemm_cases(device, M=512, N=512):
    g = torch.Generator(device="cpu").manual_seed(0)
    for K in (1024, 4096, 16384):
        for case in ("clean", "outliers", "zero rows"):
            a = torch.randn(M, K, generator=g)
            w = torch.randn(N, K, generator=g) / K ** 0.5
            if case == "outliers":
                cols = torch.randperm(K, generator=g)[:max(1, K // 1000)]
                a[:, cols] *= 100
            if case == "zero rows":
                a[torch.randperm(M, generator=g)[:M // 10]] = 0
            a, w = a.bfloat16().float().to(device), w.bfloat16().float().to(device)
            yield dict(part="gemm", K=K, case=case), fake_quant_rows(a) @ fake_quant_blocks(w).t(), a @ w.t()


def layer_cases(device, L=1024, d=1024, h=512, E=8, K=2):
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(L, d, generator=g).bfloat16().float()
    w1 = (torch.randn(E, 2 * h, d, generator=g) / d ** 0.5).bfloat16().float()
    w2 = (torch.randn(E, d, h, generator=g) / h ** 0.5).bfloat16().float()
    idx, w = route_topk(torch.randn(L, E, generator=g), K)
    dy = torch.randn(L, d, generator=g).bfloat16().float()
    names = ("out", "dx", "dw1", "dw2", "dweights")

    def run(**kw):
        ins = [t.to(device).requires_grad_() for t in (x, w1, w2, w.float())]
        out = moe_experts_reference(ins[0], idx.to(device), ins[3], ins[1], ins[2],
                                    experts=ExpertsConfig(activation="swiglu", **kw))
        return [out, *torch.autograd.grad(out, ins, dy.to(device))]

    exact = run()
    for mode, kw in (("fp8 GEMMs", dict(precision="fp8")), ("preact-fp8", dict(checkpoint="preact-fp8")),
                     ("fp8 GEMMs + preact-fp8", dict(precision="fp8", checkpoint="preact-fp8"))):
        for name, a, b in zip(names, run(**kw), exact):
            yield dict(part="layer", shape=f"{L},{d},{h},{E},{K}", mode=mode, tensor=name), a, b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    command = shlex.join(["python", "benchmarks/experiments/fp8/fp8_accuracy.py", *sys.argv[1:]])
    env = run_env(torch.device(args.device), command)
    rows = [{**key, **metrics(got, want), "device": args.device, **env}
            for key, got, want in (*gemm_cases(args.device), *layer_cases(args.device))]
    with open(os.path.join(args.out, "fp8_accuracy.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print("| what | rel. L2 | cosine | calc_diff |\n|---|---|---|---|")
    for r in rows:
        what = (f"GEMM K={r['K']}, {r['case']}" if r["part"] == "gemm"
                else f"layer {r['shape']}, {r['mode']}: {r['tensor']}")
        print(f"| {what} | {r['rel_l2']:.2e} | {r['cosine']:.6f} | {r['calc_diff']:.2e} |")


if __name__ == "__main__":
    main()
