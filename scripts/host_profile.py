"""Where the host's time to issue one moeblaze step goes (GPU only): host ms per forward+backward step and per
forward (host clock, no synchronization inside the timed loop), then cProfile over 100 steps, the functions
with the most time of their own and the most cumulative time; with --pieces, the host µs of each launch of
the step and of the parts of one launch instead (diagnostic: the host's CPU varies by ±30% between runs).

    python scripts/host_profile.py [--configs A,C] [--top 25] [--pieces]"""
import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from moeblaze.bench.harness import CONFIGS, _moeblaze, _step, make_problem  # noqa: E402


def host_ms(fn, n=100):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / n, (time.perf_counter() - t0) * 1e3 / n


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="A,C")
    p.add_argument("--top", type=int, default=25, help="functions listed per order; 0: no cProfile")
    p.add_argument("--pieces", action="store_true", help="host µs per launch and per part of one launch")
    args = p.parse_args()
    for name in args.configs.split(","):
        prob = make_problem(*CONFIGS[name])
        if args.pieces:
            pieces(prob, name)
            continue
        call = _moeblaze(prob, "preact")
        for i in range(20):  # compile, autotune, warm caches
            _step(call, prob, i, True)
        step_host, step_wall = host_ms(lambda i: _step(call, prob, i, True))
        fwd_host, _ = host_ms(lambda i: _step(call, prob, i, False))
        print(f"{name} {CONFIGS[name]}: host ms/step {step_host:.3f}, wall ms/step {step_wall:.3f}, "
              f"forward host ms {fwd_host:.3f}", flush=True)
        if args.top:
            profile(call, prob, name, args.top)
        del prob, call
        torch.cuda.empty_cache()


def profile(call, prob, name, top):
    """cProfile over 100 steps: the top functions by own time and by cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    for i in range(100):
        _step(call, prob, i, True)
    torch.cuda.synchronize()
    prof.disable()
    for key in ("tottime", "cumulative"):
        print(f"--- {name}: cProfile over 100 steps, by {key}")
        pstats.Stats(prof, stream=sys.stdout).strip_dirs().sort_stats(key).print_stats(top)


def piece_us(fn, n=20, rounds=15):
    """Median over rounds of the mean host µs of n calls issued back to back (few enough launches that
    the GPU's queue never pushes back)."""
    fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        means.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return sorted(means)[rounds // 2]


def pieces(p, name):
    """Host µs of each launch of a preact step, of the step, and of one Gluon launch by three paths."""
    from moeblaze.kernels import gluon_hopper as gh
    from moeblaze.kernels.launch import launch, sm_count
    from moeblaze.ops import experts as ox
    from moeblaze.routing import build_routing_index

    x, idx, w, dy = p.sets[0]
    x, w, w1, w2 = x.detach(), w.detach(), p.w1.detach(), p.w2.detach()
    r = build_routing_index(idx, p.E, check=False)
    counts, offsets, eti, slot = r.tensors()
    sched = ox.tile_schedule(counts, offsets, eti.shape[0])
    preact, act = ox._up(x, w1, eti, offsets, sched, "swiglu", True, True)
    E, F, D = w1.shape
    H = w2.shape[2]
    w2_nk = (w2.stride(0), w2.stride(2), w2.stride(1))
    y = ox._rows(act, w2, w2_nk, D, offsets, sched)
    dpre = torch.empty_like(preact)
    sa, _ = ox._down_bwd(dy, w2, preact, w, slot, dpre, eti, offsets, sched, "swiglu")
    call = _moeblaze(p, "preact")
    a_desc, b_desc, c_desc = gh._desc(act, [128, 64]), gh._desc(w2.reshape(-1, H), [256, 64]), gh._desc(y, [128, 256])
    args = (a_desc, b_desc, c_desc, y, *sched, offsets, D, H, y.stride(0))
    kw = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, STAGES=3, WORKER_REGS=112, B_KN=False, num_warps=8, maxnreg=168)
    grid = (sm_count(x.device), 1, 1)
    compiled = gh.rows_handoff_kernel[grid](*args, **kw)
    every = args + tuple(kw[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "WORKER_REGS", "B_KN"))
    stream = torch.cuda.current_stream().cuda_stream
    rows = {
        "routing index (3 launches)": lambda: build_routing_index(idx, p.E, check=False),
        "tile schedule": lambda: ox.tile_schedule(counts, offsets, eti.shape[0]),
        "up": lambda: ox._up(x, w1, eti, offsets, sched, "swiglu", True, True),
        "down": lambda: ox._rows(act, w2, w2_nk, D, offsets, sched),
        "combine": lambda: ox._combine(y, slot, w, x.dtype),
        "dA' + SwiGLU backward pass": lambda: ox._down_bwd(dy, w2, preact, w, slot, dpre, eti, offsets, sched,
                                                          "swiglu"),
        "dW2": lambda: ox._weight_grad(dy, sa, (E, D, H), eti, offsets, True, False, w2.dtype),
        "dW1": lambda: ox._weight_grad(dpre, x, (E, F, D), eti, offsets, False, True, w1.dtype),
        "dX~": lambda: ox._rows(dpre, w1, (w1.stride(0), w1.stride(1), w1.stride(2)), D, offsets, sched),
        "forward body": lambda: ox._experts_fwd(x, w1, w2, w, counts, offsets, eti, slot, "swiglu", True),
        "backward body": lambda: ox._experts_bwd(dy, x, w1, w2, w, *sched, offsets, eti, slot, preact, "swiglu",
                                                 True),
        "step forward": lambda: _step(call, p, 0, False),
        "step forward+backward": lambda: _step(call, p, 0, True),
        "one TMA descriptor": lambda: gh._desc(act, [128, 64]),
        "Gluon launch: Triton's dispatch": lambda: gh.rows_handoff_kernel[grid](*args, **kw),
        "Gluon launch: kernels.launch": lambda: launch(gh.rows_handoff_kernel, grid, *args, **kw),
        "Gluon launch: compiled kernel's launcher": lambda: compiled.run(*grid, stream, compiled.function,
                                                                         compiled.packed_metadata, None, None,
                                                                         None, *every),
    }
    for label, fn in rows.items():
        print(f"{name} {label:42s} host {piece_us(fn):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
