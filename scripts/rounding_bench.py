"""Token rounding against plain top-k on one GPU: a MoE layer's training step (router, rounding, experts, forward
and backward) at configs C, D and (16384, 4096, 1024, 256, 4), bf16, both in one run, timed in turns.

    python scripts/rounding_bench.py [--out DIR] [--iters 20]

"useful TF/s" counts the GEMM FLOPs of the pairs each step computed (6 · pairs · d · 3h, the SwiGLU layer's
forward and backward) over its time; a row per (config, routing) goes to DIR/rounding.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from moeblaze import MoELayer
from moeblaze.bench.harness import CONFIGS

SHAPES = {"C": CONFIGS["C"], "D": CONFIGS["D"], "E256": (16384, 4096, 1024, 256, 4)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name, (L, d, h, E, K) in SHAPES.items():
        torch.manual_seed(0)
        layers = {rule: MoELayer(d, h, E, K, token_rounding=rule).cuda().bfloat16()
                  for rule in (None, "nr-f", "up", "down")}
        base = layers[None].state_dict()
        for layer in layers.values():
            layer.load_state_dict(base)
        x = torch.randn(L, d, device="cuda", dtype=torch.bfloat16) * 0.5
        dy = torch.randn_like(x)
        times = {rule: [] for rule in layers}
        pairs = {}
        if os.environ.get("ROUNDING_DIAG"):  # host-side look at the rounded routing before any step runs
            from moeblaze.routing import round_tokens
            with torch.no_grad():
                r = layers[None].router(x)
                for rule in ("nr-f", "up", "down"):
                    rr = round_tokens(r.logits, r.topk_idx, r.topk_weights, 128, rule)
                    per_token = rr.kept_LE.sum(1)
                    print(name, rule, "pairs", int(rr.counts_E.sum()), "max experts per token", int(per_token.max()),
                          "table", layers[rule].rounding_max_experts, flush=True)
        for i in range(args.iters + 3):
            for rule, layer in layers.items():
                xi = x.clone().requires_grad_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                m = layer(xi)
                (m.out.float() * dy.float()).sum().add(m.aux_loss).backward()
                end.record()
                if i >= 3:
                    times[rule].append((start, end))
                if i == 0:
                    r = layer.router(x)
                    if rule is None:
                        pairs[rule] = L * K
                    else:
                        from moeblaze.routing import round_tokens
                        rr = round_tokens(r.logits, r.topk_idx, r.topk_weights, layer.rounding_tile, rule)
                        pairs[rule] = int(rr.counts_E.sum())
        torch.cuda.synchronize()
        base_ms = None
        for rule in layers:
            ms = statistics.median(a.elapsed_time(b) for a, b in times[rule])
            base_ms = base_ms or ms
            tf = 6 * pairs[rule] * d * 3 * h / (ms * 1e-3) / 1e12
            row = dict(config=name, L=L, d=d, h=h, E=E, K=K, routing=rule or "top-k", step_ms=round(ms, 3),
                       pairs=pairs[rule], useful_tflops=round(tf, 1), speedup_vs_topk=round(base_ms / ms, 3),
                       gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                       git_sha=os.environ.get("MOEBLAZE_GIT_SHA", "unknown"))
            rows.append(row)
            print(json.dumps(row), flush=True)
        del layers
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "rounding.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
