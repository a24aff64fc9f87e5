"""Lab notebook, 2026-11-25. Question: what does token rounding gain over plain top-k, for the experts and for the
layer, beside SonicMoE's?
Answer: at 256 experts (2 tiles each) the experts' step 1.033x top-k's (SonicMoE's 1.242x); at configs C and D,
where each expert has about 12 tiles, 0.95-0.99x; the layer step 0.81-1.07x (docs/results.md, token rounding).

Token rounding against plain top-k on one GPU, bf16, at configs C and D and (16384, 4096, 1024, 256, 4), in one run:

  experts  the experts' forward + backward on a given routing: moeblaze (index built in the step) and, where it is
           installed, SonicMoE through its general-routing API, which takes any (token, expert, score) pairs, so
           the same rounded pairs go to both; the rounding itself is done once, outside the timed step
  layer    moeblaze's MoELayer training step: router, rounding, index, experts, forward and backward
  router   the router's logits, forward + backward, on the layer's x: bf16 GEMMs accumulating in fp32 (what the
           layer runs) against fp32 GEMMs on fp32 copies (what it ran before); rows name the way, not a routing

    python benchmarks/experiments/rounding/rounding_bench.py [--out DIR] [--configs E256,D,C]
                                            [--routings top-k,nr-f,up,down] [--no-peers] [--clocks]
                                            [--profile [--profile-steps N] | --host-profile]

Routing: a fresh router's (logits ~ N(0, 1), softmax top-k, renormalized). Each step is timed in turns with the
others (CUDA events, rounds until each has had a second: moeblaze.bench.harness). "useful TF/s" counts the GEMM
FLOPs of the pairs a step computes, 18 · pairs · d · h (SwiGLU, forward and backward), over its time. One row
per (config, part, impl, routing) goes to DIR/rounding.jsonl, with its speedup over the same impl's plain top-k,
the host's ms to issue a step (host_ms: near step_ms, the host sets the pace) and the GPU's busy ms per step over
ten profiled back to back (gpu_busy_ms, the union of the kernels' intervals: step_ms minus it is time the GPU
waits). --profile prints, per step, each one's kernels and the GPU's longest idle gaps instead of timing;
--host-profile, the host's ops by their own CPU time (torch's profiler), instead of timing.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

import torch

from moeblaze import MoELayer, RoundingConfig
from moeblaze.bench.harness import steady_profile, timed_rounds
from moeblaze.bench.names import CONFIGS
from moeblaze.cli.bench import run_env
from moeblaze.experts import moe_experts
from moeblaze.routing.router import router_logits
from moeblaze.routing import RULES, build_routing_index, route_topk
from moeblaze.routing.rounding import default_max_experts, round_tokens_fast, rounded_index, rounded_rows_bound
from moeblaze.experts.schedule import BLOCK_M

SHAPES = {"C": CONFIGS["C"], "D": CONFIGS["D"], "E256": (16384, 4096, 1024, 256, 4)}


def routings(L, E, K, g, rules=RULES):
    """{routing name: (kept (L, E) bool, weights (L, E) fp32)} for plain top-k and each of the rounding rules."""
    logits = torch.randn(L, E, generator=g).cuda()
    idx, w = route_topk(logits, K)
    kept = torch.zeros(L, E, dtype=torch.bool, device="cuda").scatter_(1, idx.long(), True)
    out = {"top-k": (kept, torch.zeros(L, E, device="cuda").scatter_(1, idx.long(), w.float()))}
    for rule in rules:
        rr = round_tokens_fast(logits, idx, w, BLOCK_M, rule, max_experts=default_max_experts(E, K))  # as MoELayer
        out[rule] = (rr.kept_LE, rr.weights_LE.detach())
        if rounded_index(rr.kept_LE, rr.weights_LE, default_max_experts(E, K),
                         rounded_rows_bound(L, K, E, BLOCK_M, rule))[2]:
            raise RuntimeError(f"{rule}: the rounded pairs overflow the layer's bounds at L={L}, E={E}, K={K}")
    return out, (idx, w)


def moeblaze_experts(L, E, K, kept, weights, w1, w2, topk, rule):
    """A step of moeblaze's experts on the routing: plain top-k through the usual index, a rounding through
    rounded_index (what MoELayer does), both built inside the step."""
    if topk is not None:
        idx, w = topk
        w = w.float().requires_grad_()
        return lambda x: (moe_experts(x, build_routing_index(idx, E, check=False), w, w1, w2, check=False), w)
    wl = weights.clone().requires_grad_()
    max_experts = default_max_experts(E, K)

    def call(x):
        index, w, _ = rounded_index(kept, wl, max_experts, rounded_rows_bound(L, K, E, BLOCK_M, rule))
        return moe_experts(x, index, w, w1, w2, check=False), wl
    return call


def sonicmoe_experts(L, E, kept, weights, w1, w2):
    """SonicMoE's step on the same pairs: (token, expert) in token order, the scores gathered inside the step."""
    import sonicmoe
    from sonicmoe.enums import ActivationType

    t, e = kept.nonzero(as_tuple=True)
    t32, e32 = t.int(), e.int()
    wl = weights.clone().requires_grad_()
    w1s, w2s = w1.permute(1, 2, 0), w2.permute(1, 2, 0)

    def call(x):
        out, _ = sonicmoe.moe_general_routing_inputs(x, wl[t, e], t32, e32, w1s, None, w2s, None, E,
                                                     torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU,
                                                     False, True)
        return out, wl
    return call


def step_fn(call, x, dy, w1, w2):
    def step(i):
        out, w = call(x)
        return torch.autograd.grad(out, (x, w1, w2, w), dy)
    return step


def layer_fn(layer, x, dy):
    def step(i):
        m = layer(x)
        # out's gradient is dy and the aux loss's 1, given to autograd as they are: no fp32 copies of out and dy
        # in the step (a loss built as (out.float() * dy.float()).sum() put them in every step, routing or not)
        return torch.autograd.grad([m.out, m.aux_loss], [x, *layer.parameters()], [dy, torch.ones_like(m.aux_loss)])
    return step


def router_fns(x, weight):
    """{way: step} of the router's logits (forward + backward) on x: the layer's bf16 GEMMs and fp32 ones."""
    g = torch.randn(x.shape[0], weight.shape[0], device=x.device)

    def step(logits_fn):
        return lambda i: torch.autograd.grad(logits_fn(x, weight), (x, weight), g)
    return {"bf16-gemm": step(router_logits), "fp32-gemm": step(lambda a, b: a.float() @ b.float().t())}


def host_profile(fn, steps: int = 5, top: int = 25) -> str:
    """What the host does to issue a step: torch's profiler over `steps` steps (CPU activity only, the GPU
    synchronized before and after), ops by self CPU time per step; the ops counted are the top-level ones (not
    those an op calls)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            fn(i)
        host = (time.perf_counter() - t0) / steps
    torch.cuda.synchronize()
    ops = [e for e in prof.events() if e.cpu_parent is None]
    lines = [f"{host * 1e3:.3f} ms host a step (profiled), {len(ops) / steps:.0f} top-level ops a step; by self CPU:"]
    for k in sorted(prof.key_averages(), key=lambda k: -k.self_cpu_time_total)[:top]:
        lines.append(f"  {k.self_cpu_time_total / steps / 1e3:7.3f} ms {k.count / steps:6.1f}x  {k.key[:100]}")
    return "\n".join(lines)


def sustained(fn, seconds: float = 2.0) -> dict:
    """fn run back to back for `seconds`, the GPU's SM clock (MHz) and power (W) sampled through NVML after the
    first half second: medians. Under the power cap, work on zero rows (a ragged expert's last tile) draws less
    power than work on data, so removing it may lift the time less than the FLOPs it removes."""
    mhz, watts, t0, i = [], [], time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(5):
            fn(i)
            i += 1
        torch.cuda.synchronize()
        if time.perf_counter() - t0 > 0.5:
            mhz.append(torch.cuda.clock_rate())
            watts.append(torch.cuda.power_draw() / 1e3)
    return dict(sm_mhz=statistics.median(mhz), power_w=round(statistics.median(watts), 1)) if mhz else {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--configs", default="E256,D,C")
    ap.add_argument("--routings", default=",".join(("top-k",) + RULES), help="top-k and the rounding rules to run")
    ap.add_argument("--profile", action="store_true", help="print each step's kernels and idle gaps instead of timing")
    ap.add_argument("--profile-steps", type=int, default=10,
                    help="steps profiled back to back (hundreds: the clocks of a sustained run, as timing sees)")
    ap.add_argument("--host-profile", action="store_true",
                    help="print each step's host-side ops (torch's profiler, CPU only) by self time instead of timing")
    ap.add_argument("--no-peers", action="store_true", help="leave SonicMoE out even where it is installed")
    ap.add_argument("--clocks", action="store_true", help="rows also carry the SM clock and power of each step run "
                    "alone for 2 s (NVML: sm_mhz, power_w)")
    args = ap.parse_args()
    wanted = args.routings.split(",")
    if "top-k" not in wanted or not set(wanted) <= {"top-k", *RULES}:
        ap.error(f"--routings: top-k and any of {', '.join(RULES)}, got {args.routings!r}")
    rules = tuple(r for r in RULES if r in wanted)
    os.makedirs(args.out, exist_ok=True)
    try:
        import sonicmoe  # noqa: F401
        have_sonic = not args.no_peers
    except ImportError:
        have_sonic = False
    rows = []
    command = shlex.join(["python", "benchmarks/experiments/rounding/rounding_bench.py", *sys.argv[1:]])
    meta = run_env(torch.device("cuda"), command)
    for name in args.configs.split(","):
        L, d, h, E, K = SHAPES[name]
        g = torch.Generator().manual_seed(0)
        w1 = (torch.randn(E, 2 * h, d, generator=g) * d ** -0.5).cuda().bfloat16().requires_grad_()
        w2 = (torch.randn(E, d, h, generator=g) * h ** -0.5).cuda().bfloat16().requires_grad_()
        x = (torch.randn(L, d, generator=g) * 0.5).cuda().bfloat16().requires_grad_()
        dy = torch.randn(L, d, generator=g).cuda().bfloat16()
        routes, topk = routings(L, E, K, g, rules)
        pairs = {r: int(kept.sum()) for r, (kept, _) in routes.items()}
        for r, (kept, _) in routes.items():
            per_token = kept.sum(1)
            print(f"{name} {r}: pairs {pairs[r]} ({pairs[r] / (L * K):.3f} of L·K), experts per token "
                  f"{int(per_token.min())}..{int(per_token.max())}", flush=True)
        fns = {}
        for r, (kept, weights) in routes.items():
            fns[("experts", "moeblaze", r)] = step_fn(
                moeblaze_experts(L, E, K, kept, weights, w1, w2, topk if r == "top-k" else None, r), x, dy, w1, w2)
            if have_sonic:
                fns[("experts", "sonicmoe", r)] = step_fn(sonicmoe_experts(L, E, kept, weights, w1, w2), x, dy, w1, w2)
        layers = {}
        for r in ("top-k",) + rules:
            torch.manual_seed(0)
            layers[r] = MoELayer(d, h, E, K, rounding=None if r == "top-k" else RoundingConfig(r)).cuda().bfloat16()
            fns[("layer", "moeblaze", r)] = layer_fn(layers[r], x, dy)
        for way, fn in router_fns(x, layers["top-k"].router.weight).items():
            fns[("router", "moeblaze", way)] = fn
        for key, fn in list(fns.items()):  # compile and warm up; a failure leaves that step out, with its reason
            t0 = time.perf_counter()
            try:
                for i in range(3):
                    fn(i)
                torch.cuda.synchronize()
                print(f"{name} {key}: warm in {time.perf_counter() - t0:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name} {key}: {type(e).__name__}: {e}", flush=True)
                del fns[key]
        if args.host_profile:
            for key, fn in fns.items():
                print(f"--- {name} {key}: {host_profile(fn)}")
            continue
        if args.profile:
            for key, fn in fns.items():
                prof = steady_profile(fn, args.profile_steps)
                print(f"--- {name} {key}: per step over {args.profile_steps} back to back: span "
                      f"{prof['span_ms']:.3f} ms, GPU busy {prof['busy_ms']:.3f} ms, "
                      f"{sum(k[1] for k in prof['kernels']):.0f} launches; "
                      f"kernels (ms, calls, name):")
                for k, n, ms in prof["kernels"][:14]:
                    print(f"  {ms:8.3f} {n:5.1f}  {k[:110]}")
                print("  the GPU idle (ms, last kernel -> next kernel):")
                for ms, a, b in prof["gaps"][:6]:
                    print(f"  {ms:8.3f}  {a[:60]}  ->  {b[:60]}")
            continue
        times = timed_rounds(fns, torch.device("cuda"), iters=5)
        for (part, impl, r), res in times.items():
            if isinstance(res, Exception):
                print(f"{name} {part} {impl} {r}: {type(res).__name__}: {res}", flush=True)
                continue
            busy = steady_profile(fns[(part, impl, r)])["busy_ms"]
            ms, host_ms = res
            if part == "router":
                fp32 = times.get((part, impl, "fp32-gemm"))
                row = dict(config=name, L=L, d=d, E=E, part=part, impl=impl, way=r, step_ms=round(ms, 3),
                           vs_fp32_gemm=round(fp32[0] / ms, 3) if isinstance(fp32, tuple) else None, **meta)
            else:
                base = times.get((part, impl, "top-k"))
                row = dict(config=name, L=L, d=d, h=h, E=E, K=K, part=part, impl=impl, routing=r,
                           step_ms=round(ms, 3), pairs=pairs[r],
                           useful_tflops=round(18 * pairs[r] * d * h / (ms * 1e-3) / 1e12, 1),
                           speedup_vs_topk=round(base[0] / ms, 3) if isinstance(base, tuple) else None, **meta)
            row.update(host_ms=round(host_ms, 3), gpu_busy_ms=round(busy, 3))
            if args.clocks:
                row.update(sustained(fns[(part, impl, r)]))
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(args.out, "rounding.jsonl"), "w") as f:  # after every row: a timeout keeps them
                f.writelines(json.dumps(r) + "\n" for r in rows)
        del fns, layers, routes, w1, w2, x, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
