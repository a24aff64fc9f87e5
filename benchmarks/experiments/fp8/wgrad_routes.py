"""Lab notebook, 2026-11-30. Question: what does each route to e4m3 weight gradients cost in error, before any kernel?
Answer (docs/notes/2026-11-30.md): the folded route errs as the transposed one within 0.2 points (3.7% against 3.6%
clean), at the level of the forward's e4m3 GEMMs; a loss A/B and the kernels are still to do.

A weight gradient is dW = A^T B summed over the tokens (dW1 = x^T dH, dW2 = (s·A)^T dY per expert): its reduction
runs along the tokens, so e4m3 operands need scales along the tokens, not the 1 x 128 groups along the features
that the data GEMMs use. Three routes, emulated (moeblaze.reference.fp8's rounding, fp32 products) against the fp64
product of the same bf16 operands (the forward's e4m3 data GEMMs: ~3.7% at these K, fp8_accuracy.py):

  bf16         the operands as the kernels read them today (fp32 accumulation): the floor
  transposed   both operands quantized again in 128 x 1 groups along the tokens (one scale per 128 tokens of a
               column): a transposed quantization pass over x and dY, what DeepSeek-V3's recipe does
  folded       A (x, or dY) with one scale per token over its whole row, that scale folded into the other operand
               (B · s_A, quantized in 128 x 1 groups along the tokens by the pass that writes it: the dH pass);
               A's e4m3 rows then serve both layouts and neither x nor dY is quantized twice

Cases: clean N(0, 1) operands; A with 100x outliers in 0.1% of its channels (a per-token scale is set by them);
B's tokens spread in magnitude (a log-normal factor per token, sigma 1.5: gradients differ by token); both.

    python benchmarks/experiments/fp8/wgrad_routes.py [--tokens 4096] [--k 1024] [--n 512]

Prints a markdown table of the relative L2 error of each route per case, over all of dW and over its rows
whose channel of A is not an outlier (", rest"); then the up GEMM's error with x in 1 x 128 groups against x with one
scale per token (what the folded route's x would also feed).
"""
from __future__ import annotations

import argparse

import torch

from moeblaze.reference.fp8 import FP8, FP8_MAX, fake_quant_blocks, fake_quant_rows


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def along_tokens(t: torch.Tensor) -> torch.Tensor:
    """t (tokens, c) through e4m3 with one scale per 128 tokens of each column, in fp32."""
    return fake_quant_rows(t.t().contiguous()).t()


def per_token(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t's e4m3 values in fp32, one scale per token over its whole row)."""
    scale = t.abs().amax(1).clamp(min=1e-12) / FP8_MAX
    return (t / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).float(), scale


def routes(a: torch.Tensor, b: torch.Tensor, rest: torch.Tensor) -> dict:
    """Each route's error over all of dW and over the rows of dW whose channel of A is not an outlier (rest)."""
    exact = a.double().t() @ b.double()
    qa, s = per_token(a)
    got = {"bf16": a.t() @ b, "transposed": along_tokens(a).t() @ along_tokens(b),
           "folded": qa.t() @ along_tokens(b * s[:, None])}
    return {f"{name}{part}": rel_l2(dw[rows], exact[rows]) for part, rows in (("", slice(None)), (", rest", rest))
            for name, dw in got.items()}


def forward_gemm(a: torch.Tensor, w: torch.Tensor) -> dict:
    """The up GEMM a @ w^T that the folded route's x also feeds: x in 1 x 128 groups (today) against x with one
    scale per token (the folded route's, so that its e4m3 rows serve the weight gradient too)."""
    exact = a.double() @ w.double().t()
    qa, s = per_token(a)
    fw = fake_quant_blocks(w)
    return {"x 1 x 128": rel_l2(fake_quant_rows(a) @ fw.t(), exact), "x per token": rel_l2((qa * s[:, None]) @ fw.t(),
                                                                                             exact)}


def cases(tokens: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for outliers in (False, True):
        for spread in (False, True):
            a, b = torch.randn(tokens, k, generator=g), torch.randn(tokens, n, generator=g)
            rest = torch.ones(k, dtype=torch.bool)
            if outliers:
                cols = torch.randperm(k, generator=g)[:max(1, k // 1000)]
                a[:, cols] *= 100
                rest[cols] = False
            if spread:
                b *= torch.exp(1.5 * torch.randn(tokens, 1, generator=g))
            name = " + ".join([w for w, on in (("A outliers", outliers), ("B spread", spread)) if on]) or "clean"
            yield name, a.bfloat16().float(), b.bfloat16().float(), rest


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=512)
    args = p.parse_args(argv)
    rows = [(name, routes(a, b, rest)) for name, a, b, rest in cases(args.tokens, args.k, args.n)]
    heads = list(rows[0][1])
    print(f"relative L2 error of dW = A^T B against fp64 (tokens {args.tokens}, A {args.k} wide, B {args.n} wide)\n")
    print("| case | " + " | ".join(heads) + " |\n|---|" + "---|" * len(heads))
    for name, r in rows:
        print(f"| {name} | " + " | ".join(f"{r[h]:.2e}" for h in heads) + " |")
    w = (torch.randn(args.n, args.k, generator=torch.Generator().manual_seed(1)) / args.k ** 0.5).bfloat16().float()
    fwd = [(name, forward_gemm(a, w)) for name, a, _, _ in cases(args.tokens, args.k, args.n) if "spread" not in name]
    print(f"\nthe up GEMM x @ W1^T (W1 {args.n} x {args.k} in 128 x 128 blocks), relative L2 error against fp64\n")
    print("| case | x 1 x 128 | x per token |\n|---|---|---|")
    for name, r in fwd:
        print(f"| {name} | {r['x 1 x 128']:.2e} | {r['x per token']:.2e} |")


if __name__ == "__main__":
    main()
