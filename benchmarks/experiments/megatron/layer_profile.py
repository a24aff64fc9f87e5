"""Where one Megatron MoE layer's step (or, --what model, the few-layer GPTModel's) goes, per variant of
benchmarks/megatron_bench.py: the GPU kernels of three steps after warmup (torch.profiler), summed by name, the
largest first, and the share they take of the step, beside the step's wall time and the host's time to issue it
(no synchronization: where it nears the wall time, the host paces the step); with --host also the host's costliest
operators (self time).

    python benchmarks/experiments/megatron/layer_profile.py --variants megatron-grouped-mm,moeblaze [--host]
        [--what layer|model] [--attention flash|local] [--tokens 8192]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import megatron_bench as mb  # noqa: E402


def profile(variant: str, args) -> None:
    step = mb.make_step(args.what, variant, args)
    top, host = args.top, args.host
    wall, issue = mb.wall_and_issue(step, 3, 10)
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if host else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time_total / 3 / 1000  # ms a step
    total = sum(kernels.values())
    print(f"== {variant} {args.what}: GPU kernels {total:.2f} ms a step; the step's wall time {wall:.2f} ms, "
          f"the host's time to issue it {issue:.2f} ms (10 steps, each synchronized)")
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{ms:8.3f} ms {100 * ms / total:5.1f}%  {name[:110]}")
    if host:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="megatron-grouped-mm,moeblaze")
    ap.add_argument("--what", choices=("layer", "model"), default="layer")
    mb.step_args(ap)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--host", action="store_true", help="also the host's costliest operators")
    args = ap.parse_args()
    mb.megatron_world("29518")
    for variant in args.variants.split(","):
        profile(variant, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
