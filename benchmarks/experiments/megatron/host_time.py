"""Host time a step of the parts of a Megatron MoE layer (or, --what model, of the few-layer GPTModel), per variant
of benchmarks/megatron_bench.py: each listed function wrapped in a clock (inclusive time, no profiler, about 1 us a
call added) and the DDP hook of every parameter, beside the step's wall time and the host's time to issue it.

    python benchmarks/experiments/megatron/host_time.py --variant moeblaze --what model [--attention flash]
"""
import argparse
import collections
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import megatron_bench as mb  # noqa: E402

SECONDS = collections.defaultdict(float)
CALLS = collections.Counter()


def clocked(label: str, f):
    @functools.wraps(f)
    def g(*args, **kwargs):
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - start
            CALLS[label] += 1
    return g


def wrap(owner, name: str, label: str | None = None) -> None:
    setattr(owner, name, clocked(label or f"{getattr(owner, '__name__', owner)}.{name}", getattr(owner, name)))


def wrap_all() -> None:
    import megatron.core.distributed.distributed_data_parallel as ddp
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import moeblaze.experts as experts
    import moeblaze.experts.op as op
    import moeblaze.integrations.megatron as integration
    import moeblaze.integrations.megatron_weights as weights
    wrap(MoELayer, "route")
    wrap(integration.MoeblazeMoELayer, "forward")
    for name in ("routed", "_parts", "_operand"):
        wrap(integration.MoeblazeSequentialMLP, name)
    wrap(integration, "routed_call")
    for name in ("moe_experts", "build_routing_index", "fused_experts"):
        wrap(experts, name)
    wrap(op, "experts_forward")
    wrap(op, "experts_backward")
    wrap(weights, "add_into_main_grads")
    wrap(weights._InPlace, "backward")
    wrap(torch.Tensor, "backward", "Tensor.backward (the whole backward)")
    make = ddp.DistributedDataParallel._make_backward_post_hook
    ddp.DistributedDataParallel._make_backward_post_hook = lambda self, p: clocked("DDP's hook", make(self, p))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="moeblaze")
    ap.add_argument("--what", choices=("layer", "model"), default="layer")
    mb.step_args(ap)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    mb.megatron_world("29520")
    wrap_all()
    step = mb.make_step(args.what, args.variant, args)
    wall, issue = mb.wall_and_issue(step, 5, args.steps, warm=lambda: (SECONDS.clear(), CALLS.clear()))
    print(f"== {args.variant} {args.what} ({args.attention} attention): wall {wall:.2f} ms, the host's time to issue "
          f"it {issue:.2f} ms a step")
    for label, s in sorted(SECONDS.items(), key=lambda kv: -kv[1]):
        print(f"{s / args.steps * 1e3:8.3f} ms  {CALLS[label] / args.steps:7.1f} calls  {label}")


if __name__ == "__main__":
    main()
