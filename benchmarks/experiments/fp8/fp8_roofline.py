"""Lab notebook, 2026-11-23. Question: how fast can an e4m3 expert GEMM with DeepSeek-V3's scales be on this GPU,
against bf16?
Answer: on an H200 cuBLAS's e4m3 GEMM with row and column scales runs at 917-1291 TF/s (1.33-1.87x its bf16 GEMM),
torch's grouped e4m3 GEMM at 587-962 TF/s, a plain Triton kernel with 1x128 / 128x128 scales at 489-585 TF/s, slower
than bf16: fp8 expert kernels pay only warp-specialised (docs/results.md).

The fp8 roofline on this GPU: the expert GEMMs' shapes (configs B, D, E: up M=L·K, N=2h, K=d; down M=L·K, N=d,
K=h) as one plain GEMM and as a grouped GEMM over E equal groups, bf16 against e4m3, each timed at the power cap
(rounds of calls in turns until each has run a second: moeblaze.bench.harness).

  bf16         torch.mm (cuBLAS)                 grouped-bf16  torch._grouped_mm
  fp8-rowwise  torch._scaled_mm, row/col scales   grouped-fp8   torch._scaled_grouped_mm (rowwise)
  fp8-block    torch.nn.functional.scaled_mm with DeepSeek-V3's 1x128 / 128x128 scales, where this torch has it
  fp8-triton   a plain Triton kernel with the same scales: acc += dot(a, b) · s_a · s_b per 128-deep block
  moeblaze-fp8-gather, moeblaze-fp8-tma   (Hopper) moeblaze's Gluon fp8 row GEMM over the E groups, A read through
               its gathering loader (the identity as tokens) or by TMA (tma_a: how A in place runs)

    python benchmarks/experiments/fp8/fp8_roofline.py [--out DIR] [--configs B,D,E]

One JSON row per (config, gemm, impl).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch
import triton
import triton.language as tl

from moeblaze.bench.harness import timed_rounds
from moeblaze.bench.names import CONFIGS
from moeblaze.cli.bench import run_env
from moeblaze.reference.fp8 import FP8, FP8_MAX, quantize_blocks, quantize_rows


@triton.jit
def _fp8_block_mm(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUP_M: tl.constexpr):
    """C (M, N) bf16 = A (M, K) fp8 · B (N, K)ᵀ fp8, both K-major; A's scales (M, K/128), B's (N/128, K/128)."""
    BLOCK_K: tl.constexpr = 128
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = min(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    kb = K // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, kb):
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * K + k * BLOCK_K + offs_k[None, :])
        b = tl.load(b_ptr + offs_n[None, :].to(tl.int64) * K + k * BLOCK_K + offs_k[:, None])
        sa = tl.load(sa_ptr + offs_m * kb + k)
        sb = tl.load(sb_ptr + (pid_n * BLOCK_N // 128) * kb + k)
        acc += tl.dot(a, b) * (sa[:, None] * sb)
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(tl.bfloat16))


def triton_fp8(a8, sa, b8, sb, cfg=(128, 128, 8, 4)):
    M, K = a8.shape
    N = b8.shape[0]
    bm, bn, warps, stages = cfg
    c = torch.empty(M, N, device=a8.device, dtype=torch.bfloat16)
    _fp8_block_mm[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](a8, b8, c, sa, sb, M, N, K, bm, bn, 8,
                                                              num_warps=warps, num_stages=stages)
    return c


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def measure(name, gemm, M, N, Kd, E, meta) -> list:
    """Every impl's rows on one GEMM shape."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, Kd, device="cuda", generator=g).bfloat16()
    b = (torch.randn(N, Kd, device="cuda", generator=g) * Kd ** -0.5).bfloat16()
    a8, sa = quantize_rows(a)
    b8, sb = quantize_blocks(b)
    ar8 = a.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    br8 = b.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    a8r, b8r = (a.float() / ar8).to(FP8), (b.float() / br8).to(FP8)
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (M // E)
    bE = b.view(1, N, Kd).expand(E, N, Kd).contiguous()
    bE8r = b8r.view(1, N, Kd).expand(E, N, Kd).contiguous()
    ref = a.float() @ b.float().t()
    fns = {
        "bf16": lambda i: torch.mm(a, b.t()),
        "fp8-rowwise": lambda i: torch._scaled_mm(a8r, b8r.t(), ar8, br8.t(), out_dtype=torch.bfloat16),
        "fp8-rowwise-fastacc": lambda i: torch._scaled_mm(a8r, b8r.t(), ar8, br8.t(),
                                                          out_dtype=torch.bfloat16, use_fast_accum=True),
        "fp8-triton": lambda i: triton_fp8(a8, sa, b8, sb),
        "grouped-bf16": lambda i: torch._grouped_mm(a, bE.transpose(1, 2), offs=offs),
        "grouped-fp8": lambda i: torch._scaled_grouped_mm(a8r, bE8r.transpose(1, 2), ar8.view(-1),
                                                          br8.view(1, N).expand(E, N).contiguous(),
                                                          offs=offs, out_dtype=torch.bfloat16),
    }
    if torch.cuda.get_device_capability()[0] == 9:
        from moeblaze.experts import gluon_sm90
        from moeblaze.experts.schedule import BLOCK_M, tile_schedule

        counts = torch.full((E,), M // E, device="cuda", dtype=torch.int32)
        starts = torch.arange(E + 1, device="cuda", dtype=torch.int32) * (M // E)
        sched = tile_schedule(counts, starts, M, BLOCK_M)
        bE8, sbE = quantize_blocks(bE)
        fns["moeblaze-fp8-gather"] = lambda i: gluon_sm90.fp8_rows_gemm(a8, sa, bE8, sbE, M, starts, sched, None,
                                                                        out_dtype=torch.bfloat16, tma_a=False)
        fns["moeblaze-fp8-tma"] = lambda i: gluon_sm90.fp8_rows_gemm(a8, sa, bE8, sbE, M, starts, sched, None,
                                                                     out_dtype=torch.bfloat16)
    sf = getattr(torch.nn.functional, "scaled_mm", None)
    if sf is not None:
        ST = torch.nn.functional.ScalingType
        sa_m = sa.t().contiguous().t()  # cuBLAS takes the 1 x 128 scales M-major: strides (1, M)
        fns["fp8-block"] = lambda i: sf(a8, b8.t(), sa_m, ST.BlockWise1x128, sb.t(), ST.BlockWise128x128,
                                        output_dtype=torch.bfloat16)
    errs = {}
    for key, fn in list(fns.items()):
        try:
            out = fn(0)
            torch.cuda.synchronize()
            errs[key] = rel(out, ref)
        except Exception as e:  # noqa: BLE001
            print(f"{name} {gemm} {key}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            del fns[key]
    times = timed_rounds(fns, torch.device("cuda"), iters=10)
    for key, res in times.items():
        if isinstance(res, Exception):
            print(f"{name} {gemm} {key}: {res}", flush=True)
            continue
        row = dict(config=name, gemm=gemm, M=M, N=N, K=Kd, impl=key, ms=round(res[0], 4),
                   tflops=round(2 * M * N * Kd / (res[0] * 1e-3) / 1e12, 1), rel_err=errs[key], **meta)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--configs", default="B,D,E")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    command = shlex.join(["python", "benchmarks/experiments/fp8/fp8_roofline.py", *sys.argv[1:]])
    meta = run_env(torch.device("cuda"), command)
    rows = []
    for name in args.configs.split(","):
        L, d, h, E, K = CONFIGS[name]
        for gemm, (M, N, Kd) in (("up", (L * K, 2 * h, d)), ("down", (L * K, d, h))):
            rows += measure(name, gemm, M, N, Kd, E, meta)
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "fp8_roofline.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
