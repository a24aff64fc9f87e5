"""Times the Gluon ping-pong row GEMM prototype against the tl row kernel on the down-projection of
configs B and E (GPU only): python scripts/gluon_rows_bench.py"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from moeblaze.bench.harness import CONFIGS  # noqa: E402
from moeblaze.kernels.gluon_rows import rows_pingpong  # noqa: E402
from moeblaze.ops.experts import _rows, tile_schedule  # noqa: E402

for name in ("B", "E", "D"):
    L, d, h, E, K = CONFIGS[name]
    LK = L * K
    counts = torch.full((E,), LK // E, dtype=torch.int32, device="cuda")
    offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = counts.cumsum(0)
    a = torch.randn(LK, h, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(E, d, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
    sched = tile_schedule(counts, offsets, LK)
    tl_c = _rows(a, w2, (w2.stride(0), w2.stride(2), w2.stride(1)), d, offsets, sched)
    flops = 2 * LK * d * h
    row = [name]
    for label, fn in (("tl", lambda: _rows(a, w2, (w2.stride(0), w2.stride(2), w2.stride(1)), d, offsets, sched)),
                      *((f"gluon BN={bn} S={s}", lambda bn=bn, s=s: rows_pingpong(a, w2, offsets, sched, block_n=bn,
                                                                                  stages=s))
                        for bn, s in ((128, 4), (128, 6)))):
        try:
            c = fn()
            err = float((c.float() - tl_c.float()).norm() / tl_c.float().norm())
            ms = triton.testing.do_bench(fn, warmup=100, rep=1000)
            row.append(f"{label}: {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s (diff vs tl {err:.1e})")
        except Exception as e:  # report and go on
            row.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    print(" | ".join(row), flush=True)
