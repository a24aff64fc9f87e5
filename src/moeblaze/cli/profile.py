"""`moeblaze profile`: where one training step's memory goes, for a layer or the small model.

Counts the bytes autograd saves for backward (saved_tensors_hooks, each storage once, inputs and
parameters listed apart because they exist anyway), grouped by the module and op that saved them;
on a GPU also the allocator's figures (kept after forward, peak over the step); and the step time.
The same input then goes through the conventional pipeline (torch_gmm) for comparison.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from ..bench.baselines import torch_gmm_experts
from ..bench.harness import kernel_times
from ..bench.memory import SavedTensorCounter
from ..bench.stages import compiled_resources, stage_times
from ..experts import moe_experts
from ..env import INTERPRET
from . import UsageError, check_device, default_device
from .profile_flags import ProfileConfig
from ..nn import ModelConfig, MoELayer, MoEModel
from ..routing import build_routing_index

MB = 2 ** 20


def profile_step(module: torch.nn.Module, make_loss, inputs, device: torch.device) -> dict:
    """Saved-tensor bytes by (module:op), allocator figures and time of one forward+backward."""
    cuda = device.type == "cuda"
    params = list(module.parameters()) if module is not None else []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    with SavedTensorCounter(module, exclude=params + list(inputs)) as counter:
        loss = make_loss()
    if cuda:
        torch.cuda.synchronize()
    after_fwd = torch.cuda.memory_allocated() - base if cuda else None
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    return {"rows": counter.rows, "saved_bytes": counter.total_bytes, "kept_alloc": after_fwd,
            "peak_alloc": torch.cuda.max_memory_allocated() - base if cuda else None,
            "ms": (time.perf_counter() - t0) * 1e3}


def _drop_grads(module: torch.nn.Module, *tensors: torch.Tensor) -> None:
    for t in (*module.parameters(), *tensors):
        t.grad = None


def _print_kernels(title: str, rows) -> None:
    print(f"\n{title}: GPU time per kernel")
    total = sum(r[2] for r in rows)
    for name, n, ms in rows:
        print(f"  {name[:70]:<70} {n:>4} {ms:>9.3f} ms {100 * ms / total:>5.1f}%")


def _print_stages(rows) -> None:
    print("\nmoeblaze: each launch of the step timed alone (checkpoint=preact)")
    print(f"  {'stage':<40} {'GPU ms':>8} {'host µs':>8} {'TF/s':>6}  autotuned config")
    for name, ms, host_us, tflops, cfg, _ in rows:
        print(f"  {name:<40} {ms:>8.3f} {host_us:>8.0f} {tflops or 0:>6.0f}  {cfg or '-'}")
    print(f"  {'total':<40} {sum(r[1] for r in rows):>8.3f} {sum(r[2] for r in rows):>8.0f}")
    for name, *_, trials in rows:
        if trials:
            print(f"\n  autotuner trials, {name} (ms, fastest first)")
            for cfg, ms in sorted(trials.items(), key=lambda kv: kv[1]):
                print(f"    {ms:>8.3f}  {cfg}")


def _print_resources(rows) -> None:
    print("\ncompiled variants (autotuner trials included): registers per thread, spills, shared memory")
    for name, tile, warps, stages, regs, spills, shared in rows:
        tile_s = " ".join(f"{k}={v}" for k, v in tile.items())
        print(f"  {name:<12} {tile_s:<60} w{warps} s{stages} regs={regs} spills={spills} smem={shared // 1024}K")


def _print(title: str, r: dict, top: int = 12) -> None:
    print(f"\n{title}")
    print(f"  {'saved by (module:op)':<58} {'tensors':>7} {'MB':>10}")
    for where, n, b in r["rows"][:top]:
        print(f"  {where[:58]:<58} {n:>7} {b / MB:>10.2f}")
    if len(r["rows"]) > top:
        rest = r["rows"][top:]
        more = "(" + str(len(rest)) + " more)"
        print(f"  {more:<58} {sum(n for _, n, _ in rest):>7} {sum(b for *_, b in rest) / MB:>10.2f}")
    print(f"  {'total saved for backward (inputs and parameters excluded)':<66} {r['saved_bytes'] / MB:>10.2f}")
    if r["kept_alloc"] is not None:
        print(f"  allocator: {r['kept_alloc'] / MB:.1f} MB allocated after forward (incl. outputs), "
              f"peak {r['peak_alloc'] / MB:.1f} MB over the step")
    print(f"  step time (first, includes warm-up effects): {r['ms']:.1f} ms")


def check_run(config: ProfileConfig) -> ProfileConfig:
    """The run after the device's checks (UsageError naming the flag), before any work, with what the flags left to
    the machine decided: the device, the sizes, the backend (on the CPU the kernels run under Triton's interpreter,
    which cli.main turns on; it says which path runs)."""
    device = default_device(config.device)
    check_device(device)
    cpu = device == "cpu"
    backend = _cpu_backend(config.experts.backend) if cpu else config.experts.backend
    return dataclasses.replace(
        config, device=device, experts=dataclasses.replace(config.experts, backend=backend),
        dtype=config.dtype or ("float32" if cpu else "bfloat16"), tokens=config.tokens or (256 if cpu else 4096),
        d_model=config.d_model or (64 if cpu else 1024), d_expert=config.d_expert or (128 if cpu else 2048))


def _cpu_backend(backend: str) -> str:
    """The backend a CPU run takes (the kernels under Triton's interpreter, or the reference), said in one line."""
    if backend == "gluon":
        raise UsageError("--backend gluon runs Hopper's (sm_90) warp-specialised kernels, which the CPU's interpreter "
                         "can't: on the CPU use --backend triton or reference")
    if backend != "reference":
        if not INTERPRET:
            raise UsageError(f"--backend {backend} on the CPU runs the kernels under Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before the command starts")
        backend = "triton" if backend == "auto" else backend  # auto alone would take the reference off CUDA
    path = "the PyTorch reference runs" if backend == "reference" else "the kernels run under Triton's interpreter"
    print(f"moeblaze profile: on the CPU {path} (the kernels' own speed needs a CUDA GPU)", flush=True)
    return backend


def run(config: ProfileConfig) -> dict:
    """Profile what `config` says (profile_flags.check_flags builds it from flags)."""
    config = check_run(config)
    experts, E, K, act = config.experts, config.num_experts, config.top_k, config.experts.activation
    device, dtype = torch.device(config.device), getattr(torch, config.dtype)
    cuda = device.type == "cuda"
    L, d, h = config.tokens, config.d_model, config.d_expert
    torch.manual_seed(0)
    results = {}
    if config.target == "model":
        seq = min(L, 256)
        cfg = ModelConfig(max_seq_len=seq, d_model=d, n_layers=2, n_heads=max(1, d // 64), num_experts=E, top_k=K,
                          d_expert=h, experts=experts)
        model = MoEModel(cfg).to(device, dtype)
        idx = torch.randint(0, 256, (max(1, L // seq), seq), device=device)

        def loss_fn():
            logits, aux, z = model(idx)
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten()) + 0.01 * aux

        profile_step(model, loss_fn, [idx], device)  # warm-up (kernel compilation)
        model.zero_grad(set_to_none=True)
        results["moeblaze"] = profile_step(model, loss_fn, [idx], device)
        _print(f"MoEModel ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters), {idx.numel()} tokens, "
               f"{dtype}, {device}, experts backend={experts.backend}, checkpoint={experts.checkpoint}",
               results["moeblaze"])
        return results
    layer = MoELayer(d, h, E, K, experts=experts.native())
    layer = layer.to(device, dtype)
    x = torch.randn(L, d, device=device, dtype=dtype, requires_grad=True)
    with torch.no_grad():
        r = layer.router(x)
    routing_w = r.topk_weights.requires_grad_()
    dy = torch.randn(L, d, device=device, dtype=torch.float32)  # (out * dy).sum() saves only dy, an input

    def ours():
        routing = build_routing_index(r.topk_idx, E, check=False)
        return (moe_experts(x, routing, routing_w, layer.w1, layer.w2, experts=experts, check=False).float() * dy).sum()

    def conventional():
        return (torch_gmm_experts(x, r.topk_idx, routing_w, layer.w1, layer.w2, act).float() * dy).sum()

    head = f"L={L} d={d} h={h} E={E} K={K} {act} {dtype} on {device}"
    profile_step(None, ours, [x, routing_w, dy], device)  # warm-up (kernel compilation)
    results["moeblaze"] = profile_step(layer, ours, [x, routing_w, dy], device)
    _print(f"moeblaze experts (backend={experts.backend}, checkpoint={experts.checkpoint}, "
           f"precision={experts.precision}), "
           f"{head}", results["moeblaze"])
    if config.kernels and cuda:
        _drop_grads(layer, x, routing_w)  # else the table would hold the adds into the earlier steps' .grad
        _print_kernels("moeblaze", kernel_times(lambda: ours().backward()))
        if experts.kernels and experts.precision == "native":  # the stage table times the bf16 launches
            launch = experts.backend if experts.backend in ("tl", "gluon") else "auto"
            _print_stages(stage_times(L, d, h, E, K, act, dtype=dtype,
                                      device=device, backend=launch))
            _print_resources(compiled_resources())
    if config.compare:
        try:
            profile_step(None, conventional, [x, routing_w, dy], device)
            results["torch_gmm"] = profile_step(layer, conventional, [x, routing_w, dy], device)
            _print("conventional pipeline (argsort, gather, torch._grouped_mm, unfused activation, scatter-add), "
                   f"{head}",
                   results["torch_gmm"])
            if config.kernels and cuda:
                _drop_grads(layer, x, routing_w)
                _print_kernels("conventional", kernel_times(lambda: conventional().backward()))
            if experts.kernels:
                ratio = results["torch_gmm"]["saved_bytes"] / max(results["moeblaze"]["saved_bytes"], 1)
                print(f"\nmoeblaze keeps {ratio:.1f}x fewer bytes for backward than the conventional pipeline")
            else:
                print("\nthe PyTorch reference keeps what a conventional pipeline keeps: the kernels' saving shows "
                      "with --backend auto")
        except RuntimeError as e:
            print(f"\nconventional pipeline unavailable here: {str(e).splitlines()[0]}")
    return results
