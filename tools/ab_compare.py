"""The current moeblaze against an earlier commit's, in one process on one GPU (bf16): outputs and every
gradient compared bitwise, then step times taken in turns (harness.time_interleaved), per config, backend,
checkpoint policy and precision. Make the baseline first with `bash tools/make_baseline.sh REV` (it lands in
.baseline/moeblaze_base).

    python tools/ab_compare.py [--configs A,B,C,D,E] [--backends tl,gluon] [--policies preact,recompute]
                                 [--precisions native,fp8]
    python tools/ab_compare.py --layers     # whole MoELayers (router families, shared experts, token rounding)

The baseline is called with its ExpertsConfig (or, before it had one, in 0.1's form: moe_experts(..., activation,
checkpoint, impl="triton", backend=..., precision=...)), the current code with an ExpertsConfig. The tl kernels
are autotuned by timing, so two packages may pick different configs: "tl" rows may differ in the last bits where
they do. Where a row is not bitwise equal, the next line gives both versions' errors against the fp64 reference
(out, dx, dw1, dw2, dtopk_w)."""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".baseline"))
from moeblaze import ExpertsConfig, build_routing_index, moe_experts  # noqa: E402
from moeblaze.bench.harness import make_problem, reference_grads, run_step, time_interleaved  # noqa: E402
from moeblaze.bench.names import CONFIGS  # noqa: E402


def baseline_call(base, p, checkpoint, backend, precision):
    """The baseline's call: with its ExpertsConfig where it has one, else in 0.1's form."""
    if hasattr(base, "ExpertsConfig"):
        config = base.ExpertsConfig(activation=p.activation, checkpoint=checkpoint, backend=backend,
                                    precision=precision)

        def call(x, idx, w, w1, w2):
            r = base.routing.build_routing_index(idx, p.E, check=False)
            return base.moe_experts(x, r, w, w1, w2, config=config, check=False)
        return call

    def call_01(x, idx, w, w1, w2):
        r = base.routing.build_routing_index(idx, p.E, check=False)
        return base.moe_experts(x, r, w, w1, w2, p.activation, checkpoint, impl="triton", check=False,
                                backend=backend, precision=precision)
    return call_01


def current_call(p, checkpoint, backend, precision):
    config = ExpertsConfig(activation=p.activation, checkpoint=checkpoint, backend=backend, precision=precision)

    def call(x, idx, w, w1, w2):
        return moe_experts(x, build_routing_index(idx, p.E, check=False), w, w1, w2, experts=config, check=False)
    return call


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="A,B,C,D,E")
    ap.add_argument("--backends", default="tl,gluon")
    ap.add_argument("--policies", default="preact,recompute")
    ap.add_argument("--precisions", default="native,fp8")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--layers", action="store_true", help="compare whole MoELayers instead of the op")
    args = ap.parse_args()
    import moeblaze_base as base

    rev = open(os.path.join(os.path.dirname(__file__), "..", ".baseline", "REV")).read().strip()
    print(f"current against baseline {rev}; {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if args.layers:
        return compare_layers(base, args.iters)
    print("| config | backend | policy | precision | bitwise equal (out, dx, dw1, dw2, dtopk_w) | baseline step ms | "
          "current step ms | current / baseline |\n|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.configs.split(","):
        p = make_problem(*CONFIGS[name], dtype=torch.bfloat16, device="cuda")
        ref = None
        for backend in args.backends.split(","):
            for policy in args.policies.split(","):
                for precision in args.precisions.split(","):
                    calls = {"baseline": baseline_call(base, p, policy, backend, precision),
                             "current": current_call(p, policy, backend, precision)}
                    results = {k: run_step(c, p, 0, True) for k, c in calls.items()}
                    for k in calls:  # warm-up beyond the compiling step
                        for i in range(3):
                            run_step(calls[k], p, i, True)
                    (ob, gb), (oc, gc) = results["baseline"], results["current"]
                    equal = [torch.equal(a, b) for a, b in zip((ob,) + gb, (oc,) + gc)]
                    if not all(equal):  # both versions' errors against the fp64 reference
                        ref = ref if ref is not None else reference_grads(p, torch.float64)
                        errs = {k: " ".join(f"{rel(a, r):.2e}" for a, r in zip((o,) + g, ref))
                                for k, (o, g) in (("baseline", (ob, gb)), ("current", (oc, gc)))}
                        print(f"|   error vs fp64 | | | | baseline {errs['baseline']}; current {errs['current']} "
                              "| | | |", flush=True)
                    del results, ob, gb, oc, gc
                    times = time_interleaved(calls, p, args.iters)
                    tb, tc = times["baseline"]["step_ms"], times["current"]["step_ms"]
                    print(f"| {name} | {backend} | {policy} | {precision} | {'yes' if all(equal) else equal} | "
                          f"{tb:.2f} | {tc:.2f} | {tc / tb:.3f} |", flush=True)
                    torch.cuda.empty_cache()
        del p, ref
        torch.cuda.empty_cache()


# (name, the MoELayer options in the keyword form of baselines from before the configs, the configs): the same
# layer both ways
LAYERS = [
    ("default", {}, {}),
    ("deepseek-v3 + shared", dict(router="deepseek-v3", shared_experts=1),
     dict(router="deepseek-v3", shared=dict())),
    ("qwen3-next + gated shared", dict(router="qwen3-next", shared_experts=1, d_shared=768, shared_gate=True),
     dict(router="qwen3-next", shared=dict(d_hidden=768, gated=True))),
    ("gpt-oss", dict(router="gpt-oss"), dict(router="gpt-oss")),
    ("olmoe + rounding nr-f", dict(router="olmoe", token_rounding="nr-f"),
     dict(router="olmoe", rounding=dict(rule="nr-f"))),
]


def compare_layers(base, iters: int, dims=(1024, 512, 64, 4, 2048), device="cuda", dtype=torch.bfloat16) -> None:
    """MoELayer of the baseline (its configs, or its keyword options from before them) against the current one, by
    default bf16 on the GPU, d 1024, h 512, 64 experts, top-4, 4 sequences of 2048 tokens: the state after the same
    seed, the output, both losses and every gradient, bitwise; the step time in turns."""
    import moeblaze as cur

    D, H, E, K, T = dims

    def with_configs(pkg, opts):
        kw = {}
        if "router" in opts:
            kw["router"] = pkg.RouterConfig.family(opts["router"])
        if "shared" in opts:
            kw["shared"] = pkg.SharedConfig(**opts["shared"])
        if "rounding" in opts:
            kw["rounding"] = pkg.RoundingConfig(**opts["rounding"])
        return pkg.MoELayer(D, H, E, K, **kw)

    def current(opts):
        return with_configs(cur, opts)

    def old(opts):
        if hasattr(base, "SharedConfig"):  # a baseline with the configs: the same call as the current one
            return with_configs(base, next(new for _, o, new in LAYERS if o is opts))
        if "router" in opts:
            opts = dict(opts, router=base.routing.ROUTERS[opts["router"]])
        return base.MoELayer(D, H, E, K, **opts)

    print("| layer | state equal | bitwise equal (out, aux, z, dx, every parameter's gradient) | baseline step ms | "
          "current step ms | current / baseline |\n|---|---|---|---|---|---|", flush=True)
    x = torch.randn(4, T, D, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    for name, old_opts, new_opts in LAYERS:
        layers = {}
        for k, make, opts in (("baseline", old, old_opts), ("current", current, new_opts)):
            torch.manual_seed(0)
            layers[k] = make(opts).to(device, dtype)
        sa, sc = layers["baseline"].state_dict(), layers["current"].state_dict()
        same_state = sa.keys() == sc.keys() and all(torch.equal(sa[k], sc[k]) for k in sa)

        def step(layer):
            xi = x.clone().requires_grad_()
            layer.zero_grad(set_to_none=True)
            out, aux, z = layer(xi)
            torch.autograd.backward((out, aux, z), (dy, torch.ones_like(aux), torch.ones_like(z)))
            return [out, aux, z, xi.grad] + [p.grad for _, p in sorted(layer.named_parameters())]

        got = {k: step(m) for k, m in layers.items()}
        equal = [a is b or (a is not None and b is not None and torch.equal(a, b))
                 for a, b in zip(got["baseline"], got["current"])]
        times = {k: [] for k in layers}
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for _ in range(iters):
            for k, m in layers.items():
                sync()
                t0 = time.perf_counter()
                step(m)
                sync()
                times[k].append((time.perf_counter() - t0) * 1e3)
        tb, tc = (sorted(times[k])[len(times[k]) // 2] for k in ("baseline", "current"))
        print(f"| {name} | {'yes' if same_state else 'NO'} | {'yes' if all(equal) else equal} | {tb:.2f} | "
              f"{tc:.2f} | {tc / tb:.3f} |", flush=True)
        del layers, got
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
