"""Where the host's time to issue one moeblaze step goes (GPU only): host ms per forward+backward step and per
forward (host clock, no synchronization inside the timed loop), then cProfile over 100 steps, the functions
with the most time of their own and the most cumulative time.

    python scripts/host_profile.py [--configs A,C] [--top 25]"""
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
    args = p.parse_args()
    for name in args.configs.split(","):
        prob = make_problem(*CONFIGS[name])
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


if __name__ == "__main__":
    main()
