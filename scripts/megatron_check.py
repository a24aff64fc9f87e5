"""moeblaze's Megatron-Core layer on GPUs (NCCL): against Megatron's own MoE layer (SequentialMLP over its all-to-all
dispatcher), expert parallelism over all ranks, then a dist-checkpointing round trip; first, under expert
parallelism, a layer spec and a layer's dtype that differ on one rank, each one error on every rank. Run with

    torchrun --nproc-per-node N scripts/megatron_check.py [--out DIR]

Each check: moeblaze's layer (dispatch="moeblaze", its parameters as built, read in place, and in one buffer last
first as Megatron's distributed optimizer lays them, stacked per call; and "megatron": Megatron's dispatcher,
moeblaze's op on its rows) and Megatron's, the same weights, one forward and backward on fresh random tokens;
Megatron's layer again in fp64 is the exact result. Output, dx and every gradient (relative, Frobenius) within twice
Megatron's own error against it at the same precision (fp32, bf16) plus two of that precision's epsilons: the tests'
rule, a bound that moves with the machine's rounding. (Megatron's own fp32 error is 6-8e-7 at this shape, so a fixed
1e-6 would be under twice it.) Then the layer under Megatron's DistributedDataParallel: its experts' gradients
added into DDP's buffer by the layer, bitwise equal to DDP's own per-parameter adds. Then moeblaze's sharded state
dict saved with Megatron's dist-checkpointing loads into stock Megatron's layer and back, values bitwise equal.
Rank 0 prints one line per check and writes them to DIR/megatron_check.txt; the exit status is non-zero if any
check fails.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton

from moeblaze import ExpertsConfig
from moeblaze.experts.tl import TUNED_KERNELS


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig
    fields = dict(num_layers=1, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096, num_moe_experts=16,
                  moe_router_topk=4, moe_ffn_hidden_size=512, gated_linear_unit=True, activation_func=F.silu,
                  add_bias_linear=False, moe_token_dispatcher_type="alltoall", bias_activation_fusion=False,
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
                  expert_model_parallel_size=dist.get_world_size(), moe_grouped_gemm=False)
    return TransformerConfig(**{**fields, **overrides})


def build(mlp, cfg, seed):
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    torch.manual_seed(seed)
    layer = build_module(mlp, config=cfg) if isinstance(mlp, ModuleSpec) else mlp(config=cfg)
    return layer.cuda()


def mlps(E, **kwargs):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from moeblaze.integrations.megatron import get_moeblaze_gpt_layer_spec
    return (get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False).submodules.mlp,
            get_moeblaze_gpt_layer_spec(E, **kwargs).submodules.mlp)


def step(layer, x, dout, dtype):
    layer.zero_grad(set_to_none=True)
    x = x.detach().to(dtype).requires_grad_()
    out, _ = layer(x)
    out.backward(dout.to(dtype))
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def one_buffer(module) -> None:
    """module's parameters moved into one buffer, last first, values unchanged: as Megatron's
    DistributedDataParallel lays them out with its distributed optimizer (where moeblaze's layer stacks the
    experts' weights per call; as built, it reads them in place)."""
    params = list(module.parameters())
    flat, at = params[0].new_empty(sum(p.numel() for p in params)), 0
    for p in params[::-1]:
        view = flat[at:at + p.numel()].view(p.shape)
        view.copy_(p.data)
        p.data, at = view, at + p.numel()


def parity(name, ours_kw, dtype, T=1024, B=2, seed=0, ddp_layout=False) -> tuple[bool, str]:
    cfg = config()
    stock_mlp, ours_mlp = mlps(cfg.num_moe_experts, **ours_kw)
    stock = build(stock_mlp, cfg, seed).to(dtype)
    ours = build(ours_mlp, cfg, seed + 1).to(dtype)
    exact = build(stock_mlp, cfg, seed + 2).double()
    ours.load_state_dict(stock.state_dict())
    if ddp_layout:
        one_buffer(ours)
    exact.load_state_dict({k: v.double() if torch.is_tensor(v) else v for k, v in stock.state_dict().items()})
    g = torch.Generator(device="cuda").manual_seed(seed + dist.get_rank())
    x = torch.randn(T, B, cfg.hidden_size, generator=g, device="cuda", dtype=torch.float64)
    dout = torch.randn(T, B, cfg.hidden_size, generator=g, device="cuda", dtype=torch.float64)
    want, same, got = step(exact, x, dout, torch.float64), step(stock, x, dout, dtype), step(ours, x, dout, dtype)
    worst, ok = [], True
    pairs = [("out", got[0], same[0], want[0]), ("dx", got[1], same[1], want[1])]
    pairs += [(n, got[2][n], same[2][n], w) for n, w in want[2].items()]
    for what, a, s, w in pairs:
        bound = 2 * rel(s, w) + 2 * torch.finfo(dtype).eps
        err = rel(a, w)
        ok &= bool(torch.isfinite(a).all()) and err <= bound
        worst.append((err / bound, what, err, rel(s, w)))
    r, what, err, theirs = max(worst)
    return ok, (f"{name} {str(dtype)[6:]}: worst {what} error {err:.2e} (Megatron's own {theirs:.2e}; "
                f"{r:.2f} of the bound), {len(pairs)} tensors")


def ddp_main_grads(dtype, T=1024, B=2) -> tuple[bool, str]:
    """moeblaze's layer under Megatron's DistributedDataParallel (float32 gradient buffer), two micro-batches: its
    experts' gradients added into the buffer by the layer, one launch per kind, against DDP's hooks adding each
    (the layer's adds turned off): every main_grad bitwise equal, the experts' flagged as added."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from moeblaze.integrations import megatron_weights
    cfg = config()
    grads, add, state = [], megatron_weights.add_into_main_grads, None
    for fused in (True, False):
        layer = build(mlps(cfg.num_moe_experts)[1], cfg, 0).to(dtype)
        if state is None:  # Megatron draws each build's expert weights anew: the second loads the first's
            state = layer.state_dict()
        else:
            layer.load_state_dict(state)
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), layer)
        if not fused:
            megatron_weights.add_into_main_grads = lambda params, grad: False
        try:
            g = torch.Generator(device="cuda").manual_seed(dist.get_rank())
            for _ in range(2):
                x = torch.randn(T, B, cfg.hidden_size, generator=g, device="cuda", dtype=dtype)
                out, _ = ddp(x)
                out.backward(torch.randn(out.shape, generator=g, device="cuda", dtype=dtype))
        finally:
            megatron_weights.add_into_main_grads = add
        grads.append({n: (p.main_grad.clone(), p.grad_added_to_main_grad) for n, p in layer.named_parameters()})
    flagged = sum(added for _, added in grads[0].values())
    experts = sum("local_experts" in n for n in grads[0])
    ok = flagged == experts and all(torch.equal(m, grads[1][n][0]) for n, (m, _) in grads[0].items())
    return ok, (f"DDP main_grads {str(dtype)[6:]}: the layer's adds against DDP's hooks, two micro-batches, "
                f"{len(grads[0])} tensors bitwise; {flagged} of {experts} expert parameters added by the layer")


def round_trip(path) -> tuple[bool, str]:
    from megatron.core import dist_checkpointing
    cfg = config(moe_shared_expert_intermediate_size=1024)
    stock_mlp, ours_mlp = mlps(cfg.num_moe_experts)
    stock, ours = build(stock_mlp, cfg, 0), build(ours_mlp, cfg, 1)
    ok = True
    for src, dst, name in [(ours, stock, "ours-to-stock"), (stock, ours, "stock-to-ours")]:
        with torch.no_grad():
            for p in src.parameters():
                p.normal_()
        d = os.path.join(path, name)
        if dist.get_rank() == 0:
            os.makedirs(d)
        dist.barrier()
        dist_checkpointing.save(src.sharded_state_dict(), d)
        dst.load_state_dict(dist_checkpointing.load(dst.sharded_state_dict(), d))
        ok &= all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values())
                  if torch.is_tensor(a))
    return ok, "dist-checkpointing: moeblaze -> stock Megatron -> moeblaze, every tensor bitwise"


def agreement() -> list[tuple[bool, str]]:
    """Under expert parallelism, the last rank differing, in the expert-parallel group's first calls (so run before
    the other checks): (a) its layer spec with Megatron's dispatch where the others' has moeblaze's: one ValueError
    on every rank when the layer is built; (b) its layer in float32 where the others' are in bf16 (its experts get
    x and weights in another dtype): one ValueError on every rank at the first forward, after which every rank runs
    the agreeing forward. Never an abort or a hang."""
    cfg, world = config(), dist.get_world_size()
    odd, results = dist.get_rank() == world - 1, []
    _, theirs = mlps(cfg.num_moe_experts, dispatch="megatron" if odd else "moeblaze")
    try:
        build(theirs, cfg, 0)
        said = "built"
    except ValueError as e:
        said = f"ValueError: {str(e)[:120]}"
    results.append((said.startswith("ValueError"), f"agreement: Megatron's dispatch on rank {world - 1} only, when "
                                                    f"built: rank {dist.get_rank()} {said}"))
    _, ours = mlps(cfg.num_moe_experts)
    layer = build(ours, cfg, 0).to(torch.float32 if odd else torch.bfloat16)
    x = torch.randn(256, 2, cfg.hidden_size, device="cuda", dtype=torch.float32 if odd else torch.bfloat16)
    try:
        layer(x)
        said = "nothing raised"
    except ValueError as e:
        said = f"ValueError: {str(e)[:120]}"
    layer.bfloat16()
    out, _ = layer(x.bfloat16())  # the group goes on
    ran = bool(torch.isfinite(out.float()).all())
    then = "then ran the agreeing forward" if ran else "the next forward FAILED"
    results.append((said.startswith("ValueError") and ran, f"agreement: the layer in float32 on rank {world - 1} "
                                                           f"only, at the first forward: rank {dist.get_rank()} "
                                                           f"{said}; {then}"))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--stall-s", type=float, default=240, help="print every thread's stack and exit after this long")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.stall_s, exit=True)
    for kernel in TUNED_KERNELS.values():  # one config, two stages (fp32's tiles fit): no tuning, the same in every
        c = kernel.configs[0]               # process (each would otherwise tune on its own)
        kernel.configs = [triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=2, pre_hook=c.pre_hook)]
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16 reads it undefined where TE does not import
        moe_utils.te_general_gemm = None
    world = dist.get_world_size()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(0)
    import megatron.core
    lines = []

    def say(line):
        lines.append(line)
        if dist.get_rank() == 0:
            print(line, flush=True)
    say(f"megatron-core {megatron.core.__version__}, torch {torch.__version__}, {world} x "
        f"{torch.cuda.get_device_name()}, EP {world}")
    failed = 0
    for ok, line in agreement() if world > 1 else ():  # the group's first calls
        flag = torch.tensor([int(ok)], device="cuda")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank raised
        failed += not flag.item()
        print(("ok   " if flag.item() else "FAIL ") + line, flush=True)  # each rank's own line
        lines.append(("ok   " if flag.item() else "FAIL ") + line)
    checks = [("moeblaze", dict(), False), ("moeblaze-ddp-layout", dict(), True),
              ("moeblaze-recompute", dict(experts=ExpertsConfig(checkpoint="recompute")), False),
              ("megatron-dispatch", dict(dispatch="megatron"), False)]
    for name, kw, ddp_layout in checks:
        for dtype in (torch.float32, torch.bfloat16):
            ok, line = parity(name, kw, dtype, ddp_layout=ddp_layout)
            failed += not ok
            say(("ok   " if ok else "FAIL ") + line)
    for dtype in (torch.float32, torch.bfloat16):
        ok, line = ddp_main_grads(dtype)
        failed += not ok
        say(("ok   " if ok else "FAIL ") + line)
    with tempfile.TemporaryDirectory(dir=args.out if dist.get_rank() == 0 else None) as tmp:
        path = [tmp]
        dist.broadcast_object_list(path)
        ok, line = round_trip(path[0])
        failed += not ok
        say(("ok   " if ok else "FAIL ") + line)
        dist.barrier()
    flags = torch.tensor([failed], device="cuda")
    dist.all_reduce(flags)
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"megatron_check_ep{world}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()
    raise SystemExit(1 if flags.item() else 0)


if __name__ == "__main__":
    main()
