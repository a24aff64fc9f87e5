"""torchtitan's own MoE models trained with torchtitan's default experts and with moeblaze's (MoeblazeConverter),
side by side in one process on one GPU: tokens/s, peak memory, the loss after N steps, and the largest batch that
fits.

    python benchmarks/torchtitan_train.py --model qwen3-30b-a3b --layers 2 --seq 4096 --batch 4 --steps 20

The model is torchtitan's flavor (model_registry) cut to --layers layers, built and initialized as torchtitan does
(meta device, to_empty, init_weights), attention on torch's SDPA (causal; torchtitan 0.3's FlexAttention mask
builder needs a newer torch than 2.11), fp32 parameters under bf16 autocast (torchtitan's mixed precision without
FSDP), AdamW (fused), the cross-entropy chunked over the sequence as torchtitan's trainer does, on random tokens
(the same seed and batches for every variant). Variants: torchtitan's experts (default) or moeblaze's with
checkpoint preact, recompute, fp8 (recompute, precision="fp8" as a user gets it: e4m3 where the experts get
fp8_min_rows rows each) or e4m3 (preact, e4m3 GEMMs at every size); each row counts the experts' e4m3 GEMMs a step
(e4m3_gemms_per_step: 0 where fp8 ran native). --float8-dense adds torchtitan's float8 converter (torchao) on the
blocks' dense Linear layers of every variant, --compile compiles each block (torchtitan's apply_compile).
Each variant runs in this process after the last one's memory is freed; peak memory is torch's allocator peak
over the timed steps. One JSON line per variant goes to stdout and to --results.
Under torchrun (several GPUs): FSDP2 as torchtitan applies it (each block, then the root; bf16 parameters, fp32
gradient reduction unless --reduce-dtype says bfloat16, no autocast; the LM head a unit of its own, gathered once
for the loss chunks; --keep-gathered: the blocks keep their gathered weights from forward to backward;
--fsdp-prefetch N: the next N units' all-gathers issued explicitly), --batch
sequences per GPU; tokens/s over all GPUs, peak memory of rank 0.
With --ep N: torchtitan's expert parallelism instead, by its own code (the model config's update_from_config with
the parallelism, then the model's parallelize: the experts sharded over the EP mesh, its all-to-all dispatcher
wired); FSDP2 is not applied then (torchtitan shards experts and the rest over different meshes per parameter,
which torch 2.11's FSDP2 can't take): the other parameters are replicated in fp32 under bf16 autocast, as on one
GPU, their gradients averaged over the ranks as backward makes them (in bf16 under --reduce-dtype bfloat16), the
experts' divided by the number of ranks (each rank's experts computed every rank's tokens), which is the gradient of
the mean loss over all ranks' tokens.
A variant NAME+exact or NAME+capacity runs moeblaze's own expert parallelism on that mesh (ep_dispatch), and
NAME+DISPATCH/P the all-to-alls in P parts, each under another part's GEMMs (ep_chunks: the tokens transport's
rows split; @pairs: exact dispatch's local experts in P groups);
NAME+capacity-drop capacity dispatch with on_overflow="drop" (no host read of an overflow flag); a suffix
@TRANSPORT names EPConfig's transport (NAME+exact@pairs: a row per (token, expert) pair; the default, tokens: one
per (token, rank)), and a last suffix :WIRE its wire (NAME+capacity-drop:e4m3: the tokens' rows cross as e4m3).
Rows of moeblaze's own EP carry a2a_mb_per_step, this rank's all-to-all megabytes to other ranks per timed step.
On the CPU (no GPU): gloo, fp32 without autocast, no memory figures; a check of the code path, not a benchmark.

torchtitan 0.3.0's models import two FSDP names that torch 2.11 lacks; tests/titan.py (which builds the models
here too) stubs them where missing (only torchtitan's FSDP wrapping uses them, not run here), and the rows name
them ("stubbed").
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import titan  # noqa: E402  (tests/titan.py: torchtitan's models as the tests build them)

FLAVORS = {"qwen3-30b-a3b": ("qwen3", "30B-A3B"), "deepseek-v3-16b": ("deepseek_v3", "16B"),
           "qwen3-debug": ("qwen3", "debugmodel_moe"), "deepseek-v3-debug": ("deepseek_v3", "debugmodel")}
VARIANTS = {"default": None, "preact": dict(checkpoint="preact"), "recompute": dict(checkpoint="recompute"),
            "fp8": dict(checkpoint="recompute", precision="fp8"),
            "e4m3": dict(checkpoint="preact", precision="fp8", fp8_min_rows=0)}  # e4m3 GEMMs at every size


def model_config(name: str, layers: int, variant: str, float8_dense: bool = False):
    import importlib

    from moeblaze import EPConfig, ExpertsConfig
    from moeblaze.integrations.torchtitan import MoeblazeConverter

    family, flavor = FLAVORS[name]
    registry = importlib.import_module(f"torchtitan.models.{family}").model_registry
    base, _, ep_dispatch = variant.partition("+")
    ep_dispatch, _, wire = ep_dispatch.partition(":")
    ep_dispatch, _, transport = ep_dispatch.partition("@")
    ep_dispatch, _, chunks = ep_dispatch.partition("/")
    ep_dispatch, _, overflow = ep_dispatch.partition("-")  # capacity-drop: on_overflow="drop", no host read
    options = VARIANTS[base]
    ep = None if not ep_dispatch else EPConfig(dispatch=ep_dispatch, chunks=int(chunks or 1),
                                               transport=transport or "tokens", on_overflow=overflow or None,
                                               wire=wire or "native")
    converters = [] if options is None else [MoeblazeConverter.Config(experts=ExpertsConfig(**options), ep=ep)]
    if float8_dense:  # torchtitan's float8 converter (torchao's Float8Linear, rowwise) on the blocks' dense Linear
        # layers, not the router's nor the LM head (as torchtitan's own MoE float8 recipe, deepseek_v3's, filters them)
        from torchtitan.components.quantization import Float8LinearConverter

        converters.insert(0, Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=["lm_head", "router"],
                                                          emulate=DEVICE != "cuda"))
    config = registry(flavor, converters=converters or None).model
    config.layers = config.layers[:layers]
    return titan.sdpa(config)


def expert_parallel(config, ep: int):
    """The model of config under torchtitan's expert parallelism over every rank (its own code; see the header)."""
    from torchtitan.config import ParallelismConfig

    parallelism = ParallelismConfig(data_parallel_shard_degree=dist.get_world_size(), expert_parallel_degree=ep,
                                    spmd_backend="partial_dtensor")
    model, dims = titan.parallel_build(config, parallelism, dist.get_world_size(), DEVICE)
    model.parallelize(dims)
    return model


class GradientAverage:
    """Under --ep: the replicated parameters' gradients averaged over the ranks as backward makes them, as DDP
    overlaps its all-reduces with backward (an async all-reduce per parameter from its post-accumulate hook, on a
    process group of its own; the LM head's, whose gradients accumulate over the loss chunks, issued once they are
    done, under the body's backward); the experts' (EP shards, which computed every rank's tokens) divided by the
    number of ranks. finish() waits for them before the optimizer step. reduce_dtype bfloat16: each fp32 gradient
    crosses as a bf16 copy and the average is written back in fp32 (DDP's bf16_compress_hook; FSDP2's
    reduce_dtype under --reduce-dtype): half the bytes, the largest of which, the embedding's, are the last
    gradient backward makes and have nothing left to hide under."""

    def __init__(self, model, reduce_dtype: torch.dtype = torch.float32):
        self.world, self.pending, self.dtype = dist.get_world_size(), [], reduce_dtype
        # a communicator of its own, as DDP's: NCCL runs it beside the EP all-to-alls, not queued behind them
        self.group = dist.new_group(list(range(self.world)))
        head = {id(p) for p in model.lm_head.parameters()}
        self.head = [p for p in model.lm_head.parameters() if not hasattr(p, "to_local")]
        self.shards = [p for p in model.parameters() if hasattr(p, "to_local")]
        for p in model.parameters():
            if not hasattr(p, "to_local") and id(p) not in head:
                p.register_post_accumulate_grad_hook(self._reduce)

    def _reduce(self, p):
        op = dist.ReduceOp.AVG if DEVICE == "cuda" else dist.ReduceOp.SUM  # gloo has no AVG
        grad = p.grad.to(self.dtype)  # p.grad itself where the dtypes agree
        self.pending.append((p, grad, dist.all_reduce(grad, op=op, group=self.group, async_op=True)))

    def head_done(self):
        for p in self.head:
            if p.grad is not None:
                self._reduce(p)

    def finish(self):
        for p, grad, work in self.pending:
            work.wait()
            if DEVICE != "cuda":
                grad.div_(self.world)
            if grad is not p.grad:
                p.grad.copy_(grad)
        self.pending = []
        for p in self.shards:
            if p.grad is not None:
                p.grad.div_(self.world)


def build(config, ep: int = 1, keep_gathered: bool = False, reduce_dtype: str = "float32", prefetch: int = 0):
    torch.manual_seed(0)
    if ep > 1:
        model = expert_parallel(config, ep)
        model.to_empty(device=DEVICE)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device(DEVICE))
            for p in model.parameters():  # the replicated parameters start equal on every rank
                if not hasattr(p, "to_local"):
                    dist.broadcast(p, 0)
        model.gradient_average = GradientAverage(model, getattr(torch, reduce_dtype))
        return model
    with torch.device("meta"):
        model = config.build()
    if dist.is_initialized():  # FSDP2 as torchtitan applies it: each block, then the root; bf16 params, fp32 grads
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce_dtype))
        for block in model.layers.values():  # keep_gathered: one all-gather per block and step, not two
            fully_shard(block, mp_policy=mp, reshard_after_forward=not keep_gathered)
        fully_shard(model.lm_head, mp_policy=mp, reshard_after_forward=False)  # gathered once for all loss chunks
        fully_shard(model, mp_policy=mp)
        if prefetch:  # explicit: each unit's pre-forward (pre-backward) issues the next units' all-gathers
            units = [*model.layers.values(), model.lm_head]
            for i, unit in enumerate(units):
                unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + prefetch])
                unit.set_modules_to_backward_prefetch(units[max(0, i - prefetch):i][::-1])
    model.to_empty(device=DEVICE)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(DEVICE))
    return model


def batches(vocab: int, batch: int, seq: int, n: int):
    g = torch.Generator(device=DEVICE).manual_seed(1234 + (dist.get_rank() if dist.is_initialized() else 0))
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), device=DEVICE, generator=g)
        yield t[:, :-1], t[:, 1:]


def chunked_loss_step(model, x, y, chunks: int = 8, fsdp: bool = False, head_done=None) -> torch.Tensor:
    """Forward and backward of the mean cross-entropy with the LM head and loss computed chunk by chunk over the
    sequence, as torchtitan's trainer does (ChunkedLossWrapper, 8 chunks): the (B, L, vocab) logits never exist
    whole. Under FSDP2 (several GPUs) its mixed precision instead of autocast, the LM head a unit of its own.
    head_done: called once the LM head's gradients are whole, before the body's backward.
    """
    amp = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16, enabled=DEVICE == "cuda" and not fsdp)
    model._skip_lm_head = True
    with amp():
        h = model(x)
    h_leaf = h.detach().requires_grad_()
    total = torch.zeros((), device=x.device)
    for hc, yc in zip(h_leaf.chunk(chunks, 1), y.chunk(chunks, 1)):
        with amp():
            logits = model.lm_head(hc)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), yc.flatten(), reduction="sum")
        loss = loss / y.numel()
        loss.backward()
        total += loss.detach()
    if head_done is not None:
        head_done()
    h.backward(h_leaf.grad)
    return total


def synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def train(model, opt, vocab, batch, seq, steps, warmup, ep: int = 1):
    from moeblaze.distributed.plan import Traffic
    from moeblaze.experts import launch_counts

    losses, t0 = [], None
    fsdp = dist.is_initialized() and ep == 1
    for i, (x, y) in enumerate(batches(vocab, batch, seq, warmup + steps)):
        if i == warmup:
            synchronize()
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            Traffic.reset()
            launch_counts.clear()
        average = model.gradient_average if ep > 1 else None
        loss = chunked_loss_step(model, x, y, fsdp=fsdp, head_done=average and average.head_done)
        if ep > 1:
            average.finish()
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    synchronize()
    dt = time.perf_counter() - t0
    train.a2a_bytes = Traffic.reset()  # the timed steps' moeblaze all-to-all bytes to other ranks
    # the experts' e4m3 GEMMs the timed steps ran: 0 where precision="fp8" ran native GEMMs (fp8_min_rows)
    train.e4m3_gemms = sum(n for (stage, _backend), n in launch_counts.items() if stage == "fp8_rows")
    return dt, [float(v) for v in losses]


def profile(model, opt, vocab, batch, seq, path, args):
    """Two steps under torch.profiler after one warm-up: the CUDA kernels by total time, to path."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    train(model, opt, vocab, batch, seq, 1, 0, args.ep)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        train(model, opt, vocab, batch, seq, 2, 0, args.ep)
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90))


def comm_split(model, opt, vocab, batch, seq, ep: int, trace: str | None = None) -> dict:
    """One more step under torch.profiler (after the timed ones), split as `moeblaze train --bench-profile` splits
    its step (moeblaze.cli.parallel.profile_split: GEMMs, all-to-all, all-gather + reduce-scatter + all-reduce, and
    the communication no compute overlaps), in ms; under torchrun the largest of the ranks' values of each part."""
    from moeblaze.cli.parallel import profile_split

    split = profile_split(lambda: train(model, opt, vocab, batch, seq, 1, 0, ep), lambda: None, torch.device(DEVICE),
                          trace)
    keys = ("gemm_ms", "all_to_all_ms", "allgather_reducescatter_ms", "exposed_comm_ms", "exposed_allgather_ms",
            "exposed_reducescatter_ms", "exposed_allreduce_ms", "exposed_all_to_all_ms")
    values = torch.tensor([split[k] for k in keys], dtype=torch.float64, device=DEVICE)
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {k: round(float(v), 2) for k, v in zip(keys, values)}


def run(args, variant: str, batch: int, steps: int, warmup: int):
    config = model_config(args.model, args.layers, variant, args.float8_dense)
    model = build(config, args.ep, args.keep_gathered, args.reduce_dtype, args.fsdp_prefetch)
    if args.compile:  # torchtitan's apply_compile: each block on its own, whole graphs
        torch._dynamo.config.capture_scalar_outputs = True
        for name, block in model.layers.named_children():
            model.layers.register_module(name, torch.compile(block, fullgraph=True))
    sharded = [p for p in model.parameters() if hasattr(p, "to_local")]  # the EP shards (DTensors) under --ep
    plain = [p for p in model.parameters() if not hasattr(p, "to_local")]
    groups = [{"params": g} for g in (sharded, plain) if g]  # one fused AdamW call per group: no DTensor mixing
    opt = torch.optim.AdamW(groups, lr=args.lr, fused=DEVICE == "cuda")
    vocab = model.tok_embeddings.num_embeddings
    try:
        if args.profile and steps > 2:
            profile(model, opt, vocab, batch, args.seq, f"{args.profile}-{variant}.txt", args)
        dt, losses = train(model, opt, vocab, batch, args.seq, steps, warmup, args.ep)
        world = dist.get_world_size() if dist.is_initialized() else 1
        row = dict(variant=variant, batch=batch, seq=args.seq, steps=steps, world=world, ep=args.ep,
                   tokens_per_s=round(world * batch * args.seq * steps / dt), step_ms=round(1000 * dt / steps, 1),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else None,
                   a2a_mb_per_step=round(train.a2a_bytes / steps / 2**20, 2),
                   e4m3_gemms_per_step=train.e4m3_gemms / steps, loss_first=round(losses[0], 4),
                   loss_last=round(losses[-1], 4))
        if args.comm_split and DEVICE == "cuda":
            trace = args.trace and f"{args.trace}-{variant}-rank{dist.get_rank() if dist.is_initialized() else 0}.json"
            row.update(comm_split(model, opt, vocab, batch, args.seq, args.ep, trace))
    except torch.OutOfMemoryError:
        row = dict(variant=variant, batch=batch, seq=args.seq, oom=True)
    del model, opt
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=tuple(FLAVORS), default="qwen3-30b-a3b", help="torchtitan's flavor")
    p.add_argument("--layers", type=int, default=2, help="the flavor's first LAYERS layers")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=4, help="sequences per step of the timed runs")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW's learning rate")
    p.add_argument("--variants", default="default,preact,recompute",
                   help="of " + ",".join(VARIANTS) + "; under --ep, NAME+exact or NAME+capacity: moeblaze's own EP")
    p.add_argument("--ep", type=int, default=1, help="under torchrun: torchtitan's expert parallelism over EP ranks "
                                                     "(every rank; no FSDP2, see the header)")
    p.add_argument("--max-batch", default="", help="also find the largest batch that fits among these sizes "
                                                   "(comma-separated, increasing), per variant")
    p.add_argument("--results", default=None, help="append the JSON rows to this file")
    p.add_argument("--profile", default=None, help="before each timed run, profile two steps into PROFILE-VARIANT.txt")
    p.add_argument("--keep-gathered", action="store_true",
                   help="FSDP2 (torchrun without --ep): each block keeps its gathered weights from forward to backward "
                        "(reshard_after_forward=False), one all-gather per block and step")
    p.add_argument("--reduce-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the gradient reductions' dtype: FSDP2's (MixedPrecisionPolicy.reduce_dtype; torchtitan 0.3's "
                        "mixed_precision_reduce allows float32 only), or under --ep the replicated parameters' "
                        "all-reduces")
    p.add_argument("--fsdp-prefetch", type=int, default=0,
                   help="FSDP2: each unit's forward (backward) issues the all-gathers of the next (previous) N units "
                        "explicitly; 0: FSDP2's implicit prefetch (torchtitan's)")
    p.add_argument("--float8-dense", action="store_true",
                   help="torchtitan's float8 converter (torchao's Float8Linear, rowwise scales) on the blocks' dense "
                        "Linear layers (attention; not the router nor the LM head), beside every variant's experts")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (fullgraph), as torchtitan's apply_compile; one GPU")
    p.add_argument("--trace", default=None, help="with --comm-split: keep the profiled step's chrome trace, "
                                                 "TRACE-VARIANT-rankR.json")
    p.add_argument("--comm-split", action="store_true",
                   help="after each timed run, one profiled step: GEMM, all-to-all, all-gather/reduce-scatter and "
                        "exposed communication ms in the row, and each collective's exposed ms (GPU only)")
    args = p.parse_args()
    from importlib.metadata import version

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: FSDP2 over every GPU, --batch per GPU
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
        if DEVICE == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if args.ep > 1 and not (dist.is_initialized() and dist.get_world_size() == args.ep):
        p.error(f"--ep {args.ep} runs under torchrun with {args.ep} processes (expert parallelism over every rank)")
    for flag, on in (("--keep-gathered", args.keep_gathered), ("--fsdp-prefetch", args.fsdp_prefetch != 0)):
        if on and (args.ep > 1 or not dist.is_initialized()):
            p.error(f"{flag} applies to FSDP2: under torchrun, without --ep")
    if args.compile and dist.is_initialized():
        p.error("--compile runs on one GPU (no torchrun)")
    if args.reduce_dtype != "float32" and not dist.is_initialized():
        p.error("--reduce-dtype applies to the gradients' reductions: under torchrun")
    say = print if not dist.is_initialized() or dist.get_rank() == 0 else (lambda *a, **k: None)

    import shlex

    from moeblaze.cli.bench import run_env

    head = dict(**run_env(torch.device(DEVICE), "python benchmarks/torchtitan_train.py " + shlex.join(sys.argv[1:])),
                torchtitan=version("torchtitan"),
                model=args.model, layers=args.layers, stubbed=titan.STUBBED, keep_gathered=args.keep_gathered,
                reduce_dtype=args.reduce_dtype, fsdp_prefetch=args.fsdp_prefetch, float8_dense=args.float8_dense,
                compiled=args.compile)
    say(json.dumps(head), flush=True)
    rows = []
    for variant in args.variants.split(","):
        row = {**head, **run(args, variant, args.batch, args.steps, args.warmup)}
        rows.append(row)
        say(json.dumps(row), flush=True)
    for variant in args.variants.split(",") if args.max_batch else ():
        fits = None
        for b in (int(s) for s in args.max_batch.split(",")):
            row = run(args, variant, b, 2, 1)
            say(json.dumps({**head, "max_batch_probe": True, **row}), flush=True)
            if row.get("oom"):
                break
            fits = row
        rows.append({**head, "variant": variant, "largest_batch": fits and fits["batch"],
                     "peak_gib_at_largest": fits and fits["peak_gib"]})
        say(json.dumps(rows[-1]), flush=True)
    if args.results and say is print:
        with open(args.results, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
