"""Where the host's time to issue one moeblaze step goes (GPU only): host ms per forward+backward step and per
forward (host clock, no synchronization inside the timed loop), then cProfile over 100 steps, the functions
with the most time of their own and the most cumulative time; with --pieces, the host µs of each launch of
the step instead (diagnostic: the host's CPU varies by ±30% between runs).

    python tools/host_profile.py [--configs A,C] [--top 25] [--pieces] [--precision fp8]"""
import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from moeblaze.bench.harness import moeblaze_call, run_step, make_problem  # noqa: E402
from moeblaze.bench.names import CONFIGS  # noqa: E402


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
    p.add_argument("--pieces", action="store_true", help="host µs per launch of the step")
    p.add_argument("--precision", default="native", choices=("native", "fp8"), help="the step's GEMMs (not --pieces)")
    args = p.parse_args()
    for name in args.configs.split(","):
        prob = make_problem(*CONFIGS[name])
        if args.pieces:
            pieces(prob, name)
            continue
        call = moeblaze_call(prob, "preact", precision=args.precision)
        for i in range(20):  # compile, autotune, warm caches
            run_step(call, prob, i, True)
        step_host, step_wall = host_ms(lambda i, c=call, q=prob: run_step(c, q, i, True))
        fwd_host, _ = host_ms(lambda i, c=call, q=prob: run_step(c, q, i, False))
        print(f"{name} {CONFIGS[name]} {args.precision}: host ms/step {step_host:.3f}, wall ms/step {step_wall:.3f}, "
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
        run_step(call, prob, i, True)
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
    """Host µs of each launch of a preact step (through experts.stages, on the default backend) and of the step."""
    from moeblaze.experts import dispatch, stages
    from moeblaze.experts.op import Kept, OpInputs, OpKey, experts_backward, experts_forward
    from moeblaze.experts.stages import RowPlan
    from moeblaze.routing import build_routing_index

    key = OpKey(backend=dispatch.resolve("auto", torch.device("cuda"))).text
    scale = torch.empty(0, dtype=torch.float32, device="cuda")  # preact's scales: none in bf16

    x, idx, w, dy = p.sets[0]
    x, w, w1, w2 = x.detach(), w.detach(), p.w1.detach(), p.w2.detach()
    r = build_routing_index(idx, p.E, check=False)
    plan = RowPlan.build(r)
    inputs = OpInputs.of(x, w1, w2, w, r)
    preact, act = stages.up(plan, x, w1, "swiglu")
    y = stages.down(plan, act, w2)
    dpre = torch.empty_like(preact)
    sa, _ = stages.down_bwd(plan, dy, w2, preact, w, dpre, "swiglu")
    call = moeblaze_call(p, "preact")
    rows = {
        "routing index (3 launches)": lambda: build_routing_index(idx, p.E, check=False),
        "tile schedule": lambda: RowPlan.build(r),
        "up": lambda: stages.up(plan, x, w1, "swiglu"),
        "down": lambda: stages.down(plan, act, w2),
        "combine": lambda: stages.combine(plan, y, w, x.dtype),
        "down_bwd (dA' + SwiGLU backward)": lambda: stages.down_bwd(plan, dy, w2, preact, w, dpre, "swiglu"),
        "dW2": lambda: stages.weight_grad(plan, dy, sa, torch.empty_like(w2), True),
        "dW1": lambda: stages.weight_grad(plan, dpre, x, torch.empty_like(w1), False),
        "dX~": lambda: stages.dx_rows(plan, dpre, w1),
        "forward body": lambda: experts_forward(inputs, key),
        "backward body": lambda: experts_backward(dy, inputs, Kept(preact, scale, *plan.sched), key),
        "step forward": lambda: run_step(call, p, 0, False),
        "step forward+backward": lambda: run_step(call, p, 0, True),
    }
    for label, fn in rows.items():
        print(f"{name} {label:42s} host {piece_us(fn):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
