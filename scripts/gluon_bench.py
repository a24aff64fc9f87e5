"""Times the Gluon warp-specialised kernels against the tl kernels (GPU only), launch by launch, bf16, at the
anchor configs with every expert given L·K/E rows: the SwiGLU up-projection (H and A), the down-projection's
row GEMM, dH (dA' = dy[token] @ W2[e] by the gathering hand-off kernel, then the epilogue pass; "dA": the GEMM
alone, in every version), dX~ = dH @ W1[e]
and the weight gradients dW1, dW2 (the Gluon kernels the layer runs), and the reference-only ping-pong and
cooperative kernels ("variants"). Each Gluon kernel runs in every pipeline shape given (stages x BLOCK_K);
--baseline FILE also times an earlier version of kernels/gluon_hopper.py, e.g. made by
`git show REV:src/moeblaze/kernels/gluon_hopper.py > FILE`, and checks that its outputs are bit-identical.
Candidates alternate twice in one process, so their ratios are comparable.

    python scripts/gluon_bench.py [--configs C,D,E,B] [--launches up,down,dH,dA,dx,wgrad,variants]
                                  [--pipelines 3x64] [--baseline FILE] [--rounds 2]
--rounds 0 calls every candidate once and times nothing, for a profiler such as ncu."""
import argparse
import importlib.util
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from moeblaze.bench.harness import CONFIGS  # noqa: E402
from moeblaze.kernels import gluon_hopper as current  # noqa: E402
import moeblaze.ops.experts as ops  # noqa: E402
from moeblaze.ops.experts import _down_bwd, _rows, _up, _weight_grad, tile_schedule  # noqa: E402


def load_baseline(path):
    """An earlier gluon_hopper.py, imported beside the current one (its relative imports resolve in the package)."""
    spec = importlib.util.spec_from_file_location("moeblaze.kernels._gluon_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROUNDS = 2


def report(name, flops, candidates):
    """Times every candidate ROUNDS times, alternating; the first candidate is the reference for the output
    check (bit-identical for Gluon versions, relative difference for the tl kernel)."""
    outs = {label: fn() for label, fn in candidates}
    ref = next(iter(outs.values()))
    row = [name]
    for label, _ in candidates:
        same = torch.equal(outs[label], ref)
        diff = 0.0 if same else float((outs[label].float() - ref.float()).norm() / ref.float().norm())
        row.append(f"{label} {'identical' if same else f'diff {diff:.1e}'}")
    del outs, ref
    for r in range(ROUNDS):
        for label, fn in candidates:
            ms = triton.testing.do_bench(fn, warmup=100, rep=1000)
            row.append(f"{label}#{r + 1} {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s")
    print(" | ".join(row), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="C,D,E,B")
    p.add_argument("--launches", default="up,down,dH,dx,wgrad")
    p.add_argument("--pipelines", default="3x64", help="stages x BLOCK_K of the Gluon kernels, comma-separated")
    p.add_argument("--baseline", default=None)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per candidate; 0 runs each once (for ncu)")
    args = p.parse_args()
    global ROUNDS
    ROUNDS = args.rounds
    launches = args.launches.split(",")
    pipelines = [tuple(map(int, s.split("x"))) for s in args.pipelines.split(",")]
    base = load_baseline(args.baseline) if args.baseline else None
    versions = [("gluon", current)] + ([("baseline", base)] if base else [])
    ops.GLUON = False  # _rows and _up launch the tl kernels
    for name in args.configs.split(","):
        L, d, h, E, K = CONFIGS[name]
        LK = L * K
        counts = torch.full((E,), LK // E, dtype=torch.int32, device="cuda")
        offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
        offsets[1:] = counts.cumsum(0)
        sched = tile_schedule(counts, offsets, LK)
        perm = torch.randperm(LK, device="cuda")
        eti = (perm // K).to(torch.int32)  # each token's K rows, scattered
        token_slot = perm.argsort().to(torch.int32).view(L, K)  # row of (token t, k-th choice)
        x = torch.randn(L, d, device="cuda", dtype=torch.bfloat16)
        w1 = torch.randn(E, 2 * h, d, device="cuda", dtype=torch.bfloat16) * d ** -0.5

        def gluon(fn):
            """(label, call) for every version and pipeline shape of one Gluon launch."""
            return [(f"{v}{'' if len(pipelines) == 1 else f' {s}x{bk}'}", lambda m=m, s=s, bk=bk: fn(m, s, bk))
                    for v, m in versions for s, bk in pipelines]

        if "up" in launches:  # each launch's operands only where it is timed (B's are GBs)
            report(f"{name} up (H and A)", 2 * LK * 2 * h * d,
                   gluon(lambda m, s, bk: m.up_swiglu_ws(x, w1, eti, offsets, sched, stages=s, block_k=bk)[1])
                   + [("tl", lambda: _up(x, w1, eti, offsets, sched, "swiglu", True, True)[1])])
        if "down" in launches or "variants" in launches:
            a = torch.randn(LK, h, device="cuda", dtype=torch.bfloat16)
            w2 = torch.randn(E, d, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
            if "down" in launches:
                report(f"{name} down", 2 * LK * d * h,
                       gluon(lambda m, s, bk: m.rows_handoff(a, w2, offsets, sched, stages=s, block_k=bk))
                       + [("tl", lambda: _rows(a, w2, (w2.stride(0), w2.stride(2), w2.stride(1)), d, offsets,
                                               sched))])
            if "variants" in launches:
                report(f"{name} down, ping-pong and cooperative", 2 * LK * d * h,
                       [("hand-off", lambda: current.rows_handoff(a, w2, offsets, sched))]
                       + [(f"{'ping-pong' if pp else 'cooperative'} S={s}",
                           lambda pp=pp, s=s: current.rows_ws(a, w2, offsets, sched, pingpong=pp, stages=s))
                          for pp, s in ((True, 4), (False, 3))])
            del a, w2
        if "dH" in launches:
            dy = torch.randn(L, d, device="cuda", dtype=torch.bfloat16)
            w2 = torch.randn(E, d, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
            preact = torch.randn(LK, 2 * h, device="cuda", dtype=torch.bfloat16)
            topk_w = torch.rand(L, K, device="cuda")
            dpreact = {True: torch.empty_like(preact), False: torch.empty_like(preact)}  # one per candidate

            def dh(gluon):
                ops.GLUON = gluon
                _down_bwd(dy, w2, preact, topk_w, token_slot, dpreact[gluon], eti, offsets, sched, "swiglu")
                ops.GLUON = False
                return dpreact[gluon]
            report(f"{name} dH (with s·A, dS)", 2 * LK * d * h, [("gluon + pass", lambda: dh(True)),
                                                                  ("tl fused", lambda: dh(False))])
            del dy, w2, preact, dpreact
        if "dx" in launches:
            dpreact = torch.randn(LK, 2 * h, device="cuda", dtype=torch.bfloat16)
            report(f"{name} dX~", 2 * LK * d * 2 * h,
                   gluon(lambda m, s, bk: m.rows_handoff(dpreact, w1, offsets, sched, kn=True, stages=s, block_k=bk))
                   + [("tl", lambda: _rows(dpreact, w1, (w1.stride(0), w1.stride(1), w1.stride(2)), d, offsets,
                                           sched))])
            del dpreact
        if "dA" in launches:  # dH's GEMM alone: dA' = dy[token] @ W2[e]
            dy = torch.randn(L, d, device="cuda", dtype=torch.bfloat16)
            w2 = torch.randn(E, d, h, device="cuda", dtype=torch.bfloat16) * d ** -0.5
            report(f"{name} dA' = dy[token] @ W2[e]", 2 * LK * d * h,
                   gluon(lambda m, s, bk: m.gathered_handoff(dy, w2, eti, offsets, sched, stages=s, block_k=bk)))
            del dy, w2
        if "wgrad" in launches:
            dpreact = torch.randn(LK, 2 * h, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(L, d, device="cuda", dtype=torch.bfloat16)
            act_scaled = torch.randn(LK, h, device="cuda", dtype=torch.bfloat16)

            def wgrad(m, s, bk, gather_p):
                p, q, shape = (dy, act_scaled, (E, d, h)) if gather_p else (dpreact, x, (E, 2 * h, d))
                out = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
                return m.weight_grad_ws(p, q, eti, offsets, out, gather_p, block_k=bk, stages=s)

            def tl_wgrad(gather_p):
                if gather_p:
                    return _weight_grad(dy, act_scaled, (E, d, h), eti, offsets, True, False, dy.dtype)
                return _weight_grad(dpreact, x, (E, 2 * h, d), eti, offsets, False, True, x.dtype)
            for label, gather_p in (("dW1", False), ("dW2", True)):
                flops = 2 * LK * d * (2 * h if label == "dW1" else h)
                report(f"{name} {label}", flops,
                       gluon(lambda m, s, bk, gp=gather_p: wgrad(m, s, bk, gp))
                       + [("tl", lambda gp=gather_p: tl_wgrad(gp))])
            del dpreact, dy, act_scaled
        if "variants" in launches:
            report(f"{name} up main loop (C = x[idx] @ W1ᵀ, no epilogue)", 2 * LK * 2 * h * d,
                   [(f"{'ping-pong' if pp else 'cooperative'} S={s}",
                     lambda pp=pp, s=s: current.gathered_rows_ws(x, w1, eti, offsets, sched, pingpong=pp, stages=s))
                    for pp, s in ((True, 4), (False, 3))])
        del x, w1
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
