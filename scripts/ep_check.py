"""Expert parallelism on the GPUs of one host: the link, an all-to-all bandwidth sweep, then the EP layer against
one GPU over all ranks' tokens, bitwise (torch.equal) in bf16, on each kernel backend, checkpoint policy
(preact, recompute, preact-fp8), precision (native, fp8) and dispatch mode, with uniform and skewed routing and
empty experts; a capacity overflow under on_overflow="error" raised on every rank, the process going on after
it; the capacity mode's (on_overflow="drop") forward and backward run under
torch.cuda.set_sync_debug_mode("error"): a host sync would raise; then the capacity mode under
torch.compile(fullgraph=True) and captured in a CUDA graph (replayed on new inputs), against eager. Run with

    torchrun --nproc-per-node 2 scripts/ep_check.py [--tokens 4096] [--out DIR]
    torchrun --nproc-per-node 2 scripts/ep_check.py --uneven   # must stop every rank with the capacity message
    torchrun --nproc-per-node 2 scripts/ep_check.py --later-drop   # must end every rank (a device-side assert)
    torchrun --nproc-per-node 4 scripts/ep_check.py --only-overflow   # the overflow check alone
    torchrun --nproc-per-node 4 scripts/ep_check.py --checks-only --dispatches exact/2,exact/4   # pipelined groups
    torchrun --nproc-per-node 2 scripts/ep_check.py --agreement   # mismatches and refused inputs: errors on every rank
                                                                  # (ep_experts, ExpertParallel, parallelize,
                                                                  # torchtitan's model)

The bitwise checks run the per-pair transport (EPConfig(transport="pairs")), the bitwise reference, with the tl
kernels pinned to their first autotune config (each process would otherwise tune on its own and may pick another;
the Gluon kernels are not autotuned); --agreement checks the other transport too. Rank 0 prints one line per check
and writes them to DIR/ep_check.txt.
"""
from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import os
import subprocess
import time

import torch
import torch.distributed as dist

from moeblaze import EPConfig, ExpertsConfig
from moeblaze.distributed import ep_experts
from moeblaze.distributed.plan import CapacityOverflow
from moeblaze.experts import launch_counts, moe_experts
from moeblaze.experts.tl import TUNED_KERNELS
from moeblaze.routing import build_routing_index


def bandwidth(rank: int, world: int, device) -> list[str]:
    lines = []
    for mb in (1, 16, 64, 256, 1024):
        n = mb * 2**20 // 2
        t = torch.randn(n, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(t)
        for _ in range(3):
            dist.all_to_all_single(out, t)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            dist.all_to_all_single(out, t)
        torch.cuda.synchronize()
        s = (time.perf_counter() - t0) / 10
        sent = mb * (world - 1) / world  # bytes that leave this GPU
        lines.append(f"all_to_all {mb:5d} MB per rank: {s * 1e3:8.3f} ms, {sent / 1024 / s:7.1f} GB/s out per GPU")
    return lines


def problem(rank: int, world: int, L: int, case: str, device):
    g = torch.Generator().manual_seed(11)
    E, D, H, K = 8 * world, 2048, 768, 4
    x = torch.randn(world * L, D, generator=g)
    w1 = torch.randn(E, 2 * H, D, generator=g) / D ** 0.5
    w2 = torch.randn(E, D, H, generator=g) / H ** 0.5
    pool = E
    if case == "skewed":
        pool = 8  # every token to rank 0's experts
    scores = torch.rand(world * L, pool, generator=g)
    if case == "empty_experts":
        scores[:, 1::3] = -1  # a third of the experts never chosen
    idx = scores.topk(K, dim=1).indices.int()
    w = torch.rand(world * L, K, generator=g) + 0.1
    dy = torch.randn(world * L, D, generator=g)
    return [t.to(device) for t in (x, idx, w, dy)], w1.to(device, torch.bfloat16), w2.to(device, torch.bfloat16)


def recipe_config(recipe: str, backend: str) -> ExpertsConfig:
    """A checkpoint policy, or "fp8-" and one (precision="fp8")."""
    fp8 = recipe.startswith("fp8-")
    fp8_fields = dict(precision="fp8", fp8_min_rows=0) if fp8 else {}  # e4m3 at the check's small shapes too
    return ExpertsConfig(checkpoint=recipe.removeprefix("fp8-"), backend=backend, **fp8_fields)


def uneven(rank: int, world: int, L: int, device) -> None:
    """Capacity dispatch sized by capacity_factor alone on ranks of different token counts (rank r holds (r + 1) · L):
    the ranks disagree on the capacity, which each must stop on, by name (a device-side assert), never a hang."""
    (x, idx, w, _), w1, w2 = problem(rank, world, L * world, "uniform", device)
    n = (rank + 1) * L
    E_loc = w1.shape[0] // world
    out = ep_experts(x[:n].bfloat16(), idx[:n], w[:n], w1[:E_loc].contiguous(), w2[:E_loc].contiguous(),
                     ep_config=EPConfig("capacity", capacity_factor=1.25, transport="pairs"))
    torch.cuda.synchronize()
    print(f"rank {rank}: UNEVEN CAPACITIES WENT ON, sum {float(out.float().sum())}", flush=True)


def overflow(rank: int, world: int, L: int, device) -> str:
    """Capacity dispatch overflowing under on_overflow="error" (every token routed to rank 0's experts, 16 rows a
    pair): CapacityOverflow on every rank, a Python error; then, the process and its CUDA context intact, the same
    call in exact dispatch runs."""
    (x, idx, w, _), w1, w2 = problem(rank, world, L, "skewed", device)
    E_loc = w1.shape[0] // world
    mine, experts = slice(rank * L, (rank + 1) * L), slice(rank * E_loc, (rank + 1) * E_loc)
    args = (x[mine].bfloat16(), idx[mine], w[mine], w1[experts].contiguous(), w2[experts].contiguous())
    try:
        ep_experts(*args, ep_config=EPConfig("capacity", capacity=16, transport="pairs"))
        raised = "nothing"
    except CapacityOverflow as e:
        raised = f"CapacityOverflow ({str(e)[:60]}...)"
    out = ep_experts(*args)
    torch.cuda.synchronize()
    flags = torch.tensor([raised.startswith("Capacity") and bool(torch.isfinite(out.float()).all())], device=device,
                         dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return (f"ep={world} capacity overflow, on_overflow='error': rank {rank} raised {raised}; "
            f"{'every rank raised and then ran exact dispatch' if flags.item() else 'FAILED'}")


def check(rank: int, world: int, L: int, case: str, backend: str, checkpoint: str, device,
          dispatch: str = "exact") -> str:
    (x, idx, w, dy), w1, w2 = problem(rank, world, L, case, device)
    x, dy = x.bfloat16(), dy.bfloat16()
    E_loc = w1.shape[0] // world
    ins = [t.clone().requires_grad_() for t in (x, w, w1, w2)]
    config = recipe_config(checkpoint, backend)
    out_all = moe_experts(ins[0], build_routing_index(idx, w1.shape[0]), ins[1], ins[2], ins[3], experts=config)
    g_all = torch.autograd.grad(out_all, ins, dy)
    mine, experts = slice(rank * L, (rank + 1) * L), slice(rank * E_loc, (rank + 1) * E_loc)
    local = [x[mine].clone().requires_grad_(), w[mine].clone().requires_grad_(),
             w1[experts].clone().requires_grad_(), w2[experts].clone().requires_grad_()]
    launch_counts.clear()
    # room for all; "drop": capacity dispatch without a host sync ("error" reads its overflow flag on the host)
    kw = dict(ep_config=EPConfig("capacity", capacity=L * 4, on_overflow="drop", transport="pairs")
              if dispatch == "capacity" else  # "exact/G": G groups, pipelined
              EPConfig(chunks=int(dispatch.partition("/")[2] or 1), transport="pairs"))
    if dispatch == "capacity":  # no host sync anywhere in the layer's forward and backward
        ep_experts(local[0], idx[mine], local[1], local[2], local[3], experts=config, **kw)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    out = ep_experts(local[0], idx[mine], local[1], local[2], local[3], experts=config, **kw)
    g = torch.autograd.grad(out, local, dy[mine])
    torch.cuda.set_sync_debug_mode(0)
    ran = sorted({b for (_, b) in launch_counts})
    same = {"out": torch.equal(out, out_all[mine]), "dx": torch.equal(g[0], g_all[0][mine]),
            "dtopk_w": torch.equal(g[1], g_all[1][mine]), "dw1": torch.equal(g[2], g_all[2][experts]),
            "dw2": torch.equal(g[3], g_all[3][experts])}
    flags = torch.tensor([all(same.values())], device=device, dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    bad = [k for k, v in same.items() if not v]
    return (f"ep={world} {dispatch:>8} {case:>13} {backend:>5} {checkpoint:>9}: "
            f"{'bitwise equal to one GPU' if flags.item() else 'DIFFERS'} on every rank (kernels ran on {ran})"
            + (f"; rank {rank} differs in {bad}" if bad else ""))


def captured(rank: int, world: int, L: int, backend: str, checkpoint: str, device, mode: str) -> str:
    """Capacity dispatch under torch.compile(fullgraph=True) (mode "compile") or captured in a CUDA graph and
    replayed on new inputs copied into its buffers (mode "cuda_graph"): forward and backward against eager on the
    same inputs, bitwise."""
    def inputs(case):
        (x, idx, w, dy), w1, w2 = problem(rank, world, L, case, device)
        mine, experts = slice(rank * L, (rank + 1) * L), slice(rank * w1.shape[0] // world,
                                                               (rank + 1) * w1.shape[0] // world)
        return (x[mine].bfloat16(), idx[mine], w[mine], w1[experts].contiguous(), w2[experts].contiguous(),
                dy[mine].bfloat16())

    kw = dict(ep_config=EPConfig("capacity", capacity=L * 4, on_overflow="drop", transport="pairs"),
              experts=recipe_config(checkpoint, backend))

    def step(fn, x, idx, w, w1, w2, dy):
        out = fn(x, idx, w, w1, w2, **kw)
        return (out, *torch.autograd.grad(out, (x, w, w1, w2), dy))

    def leaves(ts):
        x, idx, w, w1, w2, dy = ts
        return x.requires_grad_(), idx, w.requires_grad_(), w1.requires_grad_(), w2.requires_grad_(), dy

    first, second = inputs("uniform"), inputs("skewed")
    want = step(ep_experts, *leaves([t.clone() for t in second]))
    if mode == "compile":
        torch._dynamo.reset()
        fn = torch.compile(ep_experts, fullgraph=True)
        step(fn, *leaves([t.clone() for t in first]))
        got = step(fn, *leaves([t.clone() for t in second]))
    else:
        static = leaves([t.clone() for t in first])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: kernels compiled and every lazy allocation made
            for _ in range(2):
                step(ep_experts, *static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step(ep_experts, *static)
        with torch.no_grad():
            for buf, new in zip(static, second):
                buf.copy_(new)
        graph.replay()
        got = outs
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    flags = torch.tensor([same], device=device, dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return (f"ep={world} capacity {mode:>10} {backend:>5} {checkpoint:>9}: "
            f"{'bitwise equal to eager' if flags.item() else 'DIFFERS'} on every rank (new inputs, skewed routing)")


def _said(fn, *args, **kwargs) -> str:
    """What fn(*args, **kwargs), meant to be refused, said: "ValueError: " and its first 150 characters, or "nothing
    raised"."""
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        return f"ValueError: {str(e)[:150]}"
    return "nothing raised"


def _on_every_rank(ok: bool, device) -> bool:
    """Whether ok holds on every rank (one all-reduce)."""
    flag = torch.tensor([int(ok)], device=device, dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def agreement(rank: int, world: int, L: int, device) -> list[str]:
    """Each entry's first call in a fresh group, with the last rank disagreeing (a checkpoint policy) or passing
    inputs it refuses (x one column wider), and ep_experts' second call with such inputs (x_width_later): an error on
    every rank, never an abort or a hang; then every rank runs the agreeing call."""
    from torch.distributed.device_mesh import init_device_mesh

    from moeblaze.distributed import ExpertParallel
    from moeblaze.nn import Experts

    (x, idx, w, _), w1, w2 = problem(rank, world, L, "uniform", device)
    E_loc = w1.shape[0] // world
    mine, experts = slice(rank * L, (rank + 1) * L), slice(rank * E_loc, (rank + 1) * E_loc)
    odd = rank == world - 1
    lines = []
    for entry in ("ep_experts", "ExpertParallel"):
        for case in ("checkpoint", "x_width") + (("x_width_later",) if entry == "ep_experts" else ()):
            group = dist.new_group(list(range(world)))  # nothing agreed in it yet
            xm = x[mine].bfloat16()
            config = ExpertsConfig(checkpoint="recompute" if case == "checkpoint" and odd else "preact")
            if case == "x_width_later":  # a call that agrees first: the refusal comes in the group's second call
                ep_experts(xm, idx[mine], w[mine], w1[experts], w2[experts], group=group, experts=config)
            if case.startswith("x_width") and odd:
                xm = torch.randn(L, x.shape[1] + 8, device=device, dtype=torch.bfloat16)
            try:
                if entry == "ep_experts":
                    ep_experts(xm, idx[mine], w[mine], w1[experts], w2[experts], group=group,
                               experts=config)
                else:
                    mesh = init_device_mesh("cuda", (world,))
                    layer = Experts(x.shape[1], w2.shape[2], w1.shape[0], experts=config).to(device, torch.bfloat16)
                    ExpertParallel(layer, mesh)(xm, idx[mine], w[mine])
                said = "nothing raised"
            except ValueError as e:
                said = f"ValueError: {str(e)[:150]}"
            out = ep_experts(x[mine].bfloat16(), idx[mine], w[mine], w1[experts], w2[experts],
                             group=group)
            torch.cuda.synchronize()
            ok = _on_every_rank(said.startswith("ValueError") and bool(torch.isfinite(out.float()).all()), device)
            lines.append(f"ep={world} {entry}, {case} on rank {world - 1}: rank {rank} {said}; "
                         + ("every rank raised, then ran the agreeing call" if ok else "FAILED"))
    lines += later_agreement(rank, world, L, device)
    return lines


def later_agreement(rank: int, world: int, L: int, device, dtypes=(torch.bfloat16, torch.float16)) -> list[str]:
    """ep_experts after a group's first call: the values ride on the transport's first exchange as their signature.
    The ranks agree on calls in each of dtypes (bf16, fp16), then the last rank passes the second where the others
    pass the first
    (each rank's own values were agreed before): one error naming the dtypes on every rank, then the agreeing call
    runs; for each transport that reads the exchange on the host (tokens exact, pairs exact, pairs capacity)."""
    (x, idx, w, _), w1, w2 = problem(rank, world, L, "uniform", device)
    E_loc = w1.shape[0] // world
    mine, experts = slice(rank * L, (rank + 1) * L), slice(rank * E_loc, (rank + 1) * E_loc)
    odd, lines = rank == world - 1, []
    for ep_config in (EPConfig(), EPConfig(transport="pairs"),
                      EPConfig("capacity", capacity=4 * L, transport="pairs")):
        group = dist.new_group(list(range(world)))

        def call(dtype, group=group, ep_config=ep_config):
            return ep_experts(x[mine].to(dtype), idx[mine], w[mine].to(dtype), w1[experts].to(dtype),
                              w2[experts].to(dtype), group=group, ep_config=ep_config)

        call(dtypes[0]), call(dtypes[1])
        try:
            call(dtypes[odd])
            said, named = "nothing raised", False
        except ValueError as e:
            said, named = f"ValueError: {str(e)[:150]}", all(f"'{dtype}'" in str(e) for dtype in dtypes)
        out = call(dtypes[0])
        torch.cuda.synchronize()
        ok = _on_every_rank(said.startswith("ValueError") and named and bool(torch.isfinite(out.float()).all()),
                            device)
        what = f"{ep_config.transport} {ep_config.dispatch}"
        lines.append(f"ep={world} ep_experts {what}, a third call in {dtypes[1]} on rank {world - 1} (calls in "
                     f"{dtypes[0]} and in {dtypes[1]} agreed before): rank {rank} {said}; "
                     + ("every rank raised naming the dtypes, then ran the agreeing call" if ok else "FAILED"))
    return lines


def later_drop(rank: int, world: int, L: int, device, dtypes=(torch.bfloat16, torch.float16)) -> int:
    """The same later-call mismatch under capacity dispatch with on_overflow="drop", which never reads the device
    on the host: every rank must end (a device-side assert, stops.assert_none) rather than hang or go on with
    collectives that don't match. Prints what each rank saw; the process is expected to die."""
    (x, idx, w, _), w1, w2 = problem(rank, world, L, "uniform", device)
    E_loc = w1.shape[0] // world
    mine, experts = slice(rank * L, (rank + 1) * L), slice(rank * E_loc, (rank + 1) * E_loc)
    ep_config = EPConfig("capacity", capacity=2 * L, on_overflow="drop")

    def call(dtype):
        return ep_experts(x[mine].to(dtype), idx[mine], w[mine].to(dtype), w1[experts].to(dtype),
                          w2[experts].to(dtype), ep_config=ep_config)

    call(dtypes[0]), call(dtypes[1])
    torch.cuda.synchronize()
    print(f"rank {rank}: calls in {dtypes[0]} and in {dtypes[1]} agreed; a third in {dtypes[rank == world - 1]}",
          flush=True)
    try:
        out = call(dtypes[rank == world - 1])
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (what the rank saw is the output)
        print(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        raise SystemExit(3) from e
    print(f"rank {rank}: FAILED: nothing raised (finite {bool(torch.isfinite(out.float()).all())})", flush=True)
    return 1


def titan_agreement(rank: int, world: int, device) -> list[str]:
    """torchtitan's Qwen3 debug model (2 layers, torchtitan's own expert-parallel build) with moeblaze's experts on
    its EP mesh (MoeblazeConverter(ep=EPConfig())), the last rank differing: (a) its recipe another checkpoint
    policy; (b) its forward under float16 autocast where the others' is under bfloat16, so that its experts get x
    in another dtype. Each an error on every rank at the first forward, never an abort or a hang; then, in (b),
    every rank runs the agreeing forward."""
    import sys
    from pathlib import Path

    from torchtitan.config import ParallelismConfig

    from moeblaze.integrations.torchtitan import MoeblazeConverter

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import titan

    odd, lines = rank == world - 1, []
    for case in ("checkpoint", "x_dtype"):
        recipe = ExpertsConfig(checkpoint="recompute" if case == "checkpoint" and odd else "preact")
        config = titan.model_config("qwen3", [MoeblazeConverter.Config(experts=recipe, ep=EPConfig())])
        parallelism = ParallelismConfig(data_parallel_shard_degree=world, expert_parallel_degree=world,
                                        spmd_backend="partial_dtensor")
        model, dims = titan.parallel_build(config, parallelism, world, "cuda")  # a fresh mesh: nothing agreed
        model.parallelize(dims)
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=device)
        tokens = torch.randint(0, 256, (2, 64), device=device)
        dtype = torch.float16 if case == "x_dtype" and odd else torch.bfloat16
        with torch.autocast("cuda", dtype=dtype):
            said = _said(model, tokens)
        ran = True
        if case == "x_dtype":  # the group goes on: every rank's forward in bfloat16
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ran = bool(torch.isfinite(model(tokens).float()).all())
        torch.cuda.synchronize()
        ok = _on_every_rank(said.startswith("ValueError") and ran, device)
        lines.append(f"ep={world} torchtitan's model, {case} on rank {world - 1}: rank {rank} {said}; "
                     + ("every rank raised" + (", then ran the agreeing forward" if case == "x_dtype" else "")
                        if ok else "FAILED"))
    return lines


def fsdp_agreement(rank: int, world: int, device) -> list[str]:
    """parallelize (FSDP2 with expert parallelism over all ranks) where the last rank wraps differently (its
    resharding, or its mixed precision): one error on every rank before any FSDP2 collective, never an abort or a
    hang; then the agreeing parallelize and a forward and backward run on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moeblaze import ModelConfig, MoEModel
    from moeblaze.distributed import parallelize

    def model():
        torch.manual_seed(0)
        return MoEModel(ModelConfig(vocab_size=256, max_seq_len=16, d_model=64, n_layers=2, n_heads=4,
                                    num_experts=4 * world, top_k=2, d_expert=64,
                                    experts=ExpertsConfig(backend="triton"))).to(device)

    odd, lines = rank == world - 1, []
    mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("efsdp", "ep"))
    cases = {"reshard_after_forward": dict(reshard_after_forward=not odd),
             "mixed_precision": dict(mp_policy=MixedPrecisionPolicy(
                 param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if odd else torch.bfloat16))}
    for case, kw in cases.items():
        said = _said(parallelize, model(), mesh, **kw)
        lines.append(f"ep={world} parallelize, {case} on rank {world - 1}: rank {rank} {said}; "
                     + ("every rank raised" if _on_every_rank(said.startswith("ValueError"), device) else "FAILED"))
    m = parallelize(model(), mesh)  # the group goes on
    logits, _, _ = m(torch.randint(0, 256, (2, 16), device=device))
    logits.float().square().mean().backward()
    ran = _on_every_rank(bool(torch.isfinite(logits).all()), device)
    lines.append(f"ep={world} parallelize, agreeing: rank {rank} " + ("ran a step" if ran else "FAILED"))
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--out", default=".")
    ap.add_argument("--only-captured", action="store_true", help="only the torch.compile and CUDA graph checks")
    ap.add_argument("--only-overflow", action="store_true", help="only the overflow check (on_overflow='error')")
    ap.add_argument("--dispatches", default="exact,capacity",
                    help="the dispatch modes checked: exact, capacity, exact/G (the local experts in G groups)")
    ap.add_argument("--checks-only", action="store_true",
                    help="only the bitwise checks (no bandwidth sweep, overflow, compile or CUDA graph)")
    ap.add_argument("--agreement", action="store_true",
                    help="only the agreement checks: a mismatch and a refused input, an error on every rank")
    ap.add_argument("--bound", type=int, default=240,
                    help="--agreement: seconds after which a rank still running prints its stack and exits")
    ap.add_argument("--later-drop", action="store_true",
                    help="only a later call's mismatch under capacity dispatch with on_overflow='drop': every rank "
                         "must end (a device-side assert)")
    ap.add_argument("--uneven", action="store_true",
                    help="only capacity_factor sizing on ranks of different token counts: every rank must stop")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    if args.uneven:
        return uneven(rank, world, args.tokens, device)
    if args.later_drop:
        return later_drop(rank, world, args.tokens, device)
    if args.agreement:  # each part's lines as it ends; a rank still waiting after the bound prints where
        faulthandler.dump_traceback_later(args.bound, exit=True)
        parts = [lambda: agreement(rank, world, args.tokens, device), lambda: fsdp_agreement(rank, world, device)]
        if importlib.util.find_spec("torchtitan") is not None:
            parts.append(lambda: titan_agreement(rank, world, device))
        lines = []
        for part in parts:
            said = part()
            print("\n".join(said), flush=True)
            lines += said
        dist.destroy_process_group()
        return 1 if any("FAILED" in line for line in lines) else 0
    if args.only_overflow:
        line = overflow(rank, world, args.tokens, device)
        print(line, flush=True)
        dist.destroy_process_group()
        return 1 if "FAILED" in line else 0
    for kernel in TUNED_KERNELS.values():  # one config in every process (the bitwise checks)
        kernel.configs = kernel.configs[:1]
    lines = []
    if rank == 0:
        lines.append(subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout)
    if not args.only_captured and not args.checks_only:
        lines += bandwidth(rank, world, device)
        lines.append(overflow(rank, world, args.tokens, device))
        if rank == 0:
            print(lines[-1], flush=True)
    backends = ["tl"] + (["gluon"] if torch.cuda.get_device_capability(device)[0] == 9 else [])
    for dispatch in () if args.only_captured else args.dispatches.split(","):
        for case in ("uniform", "skewed", "empty_experts"):
            for backend in backends:
                for checkpoint in ("preact", "recompute", "preact-fp8", "fp8-preact", "fp8-recompute"):
                    lines.append(check(rank, world, args.tokens, case, backend, checkpoint, device, dispatch))
                    if rank == 0:
                        print(lines[-1], flush=True)
    for mode in () if args.checks_only else ("compile", "cuda_graph"):
        for backend in backends:
            for checkpoint in ("preact", "recompute"):
                try:
                    lines.append(captured(rank, world, args.tokens, backend, checkpoint, device, mode))
                except Exception as e:  # noqa: BLE001 (reported, and the other checks still run)
                    lines.append(f"ep={world} capacity {mode:>10} {backend:>5} {checkpoint:>9}: FAILED "
                                 f"{type(e).__name__}: {str(e)[:300]}")
                if rank == 0:
                    print(lines[-1], flush=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ep_captured.txt" if args.only_captured else "ep_check.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines[:7]))
    dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
