"""Where one Megatron MoE layer's step goes, per variant of benchmarks/megatron_bench.py: the GPU kernels of three
steps after warmup (torch.profiler), summed by name, the largest first, and the share they take of the step.

    python benchmarks/experiments/megatron/layer_profile.py --variants megatron-grouped-mm,moeblaze
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import megatron_bench as mb  # noqa: E402


def profile(variant: str, tokens: int, top: int) -> None:
    model = mb.build("layer", variant, 1)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4096, tokens // 4096, mb.QWEN3_30B["hidden_size"], device="cuda", dtype=torch.bfloat16,
                    generator=g, requires_grad=True)
    dout = torch.randn_like(x)

    def step():
        out, _ = model(x)
        out.backward(dout)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time_total / 3 / 1000  # ms a step
    total = sum(kernels.values())
    print(f"== {variant}: GPU kernels {total:.2f} ms a step")
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{ms:8.3f} ms {100 * ms / total:5.1f}%  {name[:110]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="megatron-grouped-mm,moeblaze")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):  # as megatron_bench's child stands it in
        moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    for variant in args.variants.split(","):
        profile(variant, args.tokens, args.top)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
