"""Times the Gluon warp-specialised kernels against the tl kernels at configs B, E and D (GPU only): the
down-projection's row GEMM (hand-off, ping-pong, cooperative), dX~ = dH @ W1[e] (hand-off), the SwiGLU
up-projection (hand-off, storing H and A like the tl kernel) and the up-projection's main loop alone
(ping-pong, cooperative).
    python scripts/gluon_bench.py [down] [dx] [up]   (default: all)"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from moeblaze.bench.harness import CONFIGS  # noqa: E402
from moeblaze.kernels.gluon_hopper import gathered_rows_ws, rows_handoff, rows_ws, up_swiglu_ws  # noqa: E402
import moeblaze.ops.experts as ops  # noqa: E402
from moeblaze.ops.experts import _rows, _up, tile_schedule  # noqa: E402


ops.GLUON = False  # _rows, _up and _down_bwd launch the tl kernels unless a candidate turns this on
VARIANTS = [(True, 4), (False, 3)]  # (ping-pong, stages)
LAUNCHES = sys.argv[1:] or ["down", "dx", "up"]


def report(name, flops, ref, candidates):
    row = [name]
    for label, fn in candidates:
        try:
            c = fn()
            diff = None if ref is None else float((c.float() - ref.float()).norm() / ref.float().norm())
            err = "" if ref is None else f", diff vs tl {diff:.1e}"
            ms = triton.testing.do_bench(fn, warmup=100, rep=1000)
            row.append(f"{label}: {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s{err}")
        except Exception as e:  # report and go on
            row.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    print(" | ".join(row), flush=True)


for name in ("B", "E", "D"):
    L, d, h, E, K = CONFIGS[name]
    LK = L * K
    counts = torch.full((E,), LK // E, dtype=torch.int32, device="cuda")
    offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = counts.cumsum(0)
    sched = tile_schedule(counts, offsets, LK)
    eti = torch.randperm(LK, device="cuda").to(torch.int32) // K  # each token's K rows, scattered
    x = torch.randn(L, d, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * h, d, device="cuda", dtype=torch.bfloat16) * d ** -0.5
    if "down" in LAUNCHES:  # each launch's operands only where it is timed (B's are GBs)
        a = torch.randn(LK, h, device="cuda", dtype=torch.bfloat16)
        w2 = torch.randn(E, d, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
        down = (lambda: _rows(a, w2, (w2.stride(0), w2.stride(2), w2.stride(1)), d, offsets, sched))
        report(f"{name} down", 2 * LK * d * h, down(),
               [("tl", down), ("gluon handoff S=3", lambda: rows_handoff(a, w2, offsets, sched))]
               + [(f"gluon {'pp' if p else 'coop'} S={s}",
                  lambda s=s, p=p: rows_ws(a, w2, offsets, sched, pingpong=p, stages=s)) for p, s in VARIANTS])
    if "dx" in LAUNCHES:
        dpreact = torch.randn(LK, 2 * h, device="cuda", dtype=torch.bfloat16)

        def dx_rows(gluon):
            ops.GLUON = gluon
            return _rows(dpreact, w1, (w1.stride(0), w1.stride(1), w1.stride(2)), d, offsets, sched)
        report(f"{name} dX~", 2 * LK * d * 2 * h, dx_rows(False),
               [("tl", lambda: dx_rows(False)), ("gluon hand-off", lambda: dx_rows(True))])
    ops.GLUON = False
    if "up" in LAUNCHES:
        tl_up = _up(x, w1, eti, offsets, sched, "swiglu", True, True)
        report(f"{name} up, H and A", 2 * LK * 2 * h * d, tl_up[1],
               [("tl", lambda: _up(x, w1, eti, offsets, sched, "swiglu", True, True)[1])]
               + [(f"gluon ws S=3 regs {r}", lambda r=r: up_swiglu_ws(x, w1, eti, offsets, sched, worker_regs=r)[1])
                  for r in (112,)])
        report(f"{name} up", 2 * LK * 2 * h * d, None,
               [("tl (with epilogue)", lambda: _up(x, w1, eti, offsets, sched, "swiglu", True, True))]
               + [(f"gluon main loop {'pp' if p else 'coop'} S={s}",
                   lambda s=s, p=p: gathered_rows_ws(x, w1, eti, offsets, sched, pingpong=p, stages=s))
                  for p, s in VARIANTS])
