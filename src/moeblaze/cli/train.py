"""`moeblaze train`: train the small MoE language model on the built-in corpus.

Every flag is checked before any work starts (cli/train_flags.py: the flags and their own checks, before torch
loads; cli/train_setup.py: the device, backend, processes and files). Checkpoints (model,
optimizer, step, data-sampler state, config) are written atomically with a checksum and verified on --resume (see
cli/checkpoint.py).
--resume without a checkpoint at --save says so on one line and starts from step 0. A non-finite training
loss stops the run with an error naming the step, before anything is saved, so the last checkpoint is never
overwritten by a diverged state (the check rides on the run's existing host reads, every 10 steps and before
every evaluation and save, so it adds no host sync).

Under `torchrun --nproc-per-node N` (see cli/parallel.py): FSDP2 on all N processes and, with --ep, expert
parallelism on a 2-D mesh; --batch-size is per process (the global batch is N times it: the batch one process
would draw, split across the ranks, so that one process at N x the batch sees the same tokens); the losses
logged and the validation loss are global means; checkpoints are sharded folders (torch.distributed.checkpoint).
--bench-steps times that many steps after --bench-warmup and writes one results row (tokens/s per GPU, peak memory,
the step split with --bench-profile) instead of training to --steps. --cuda-graph replays the step (forward,
backward, clipping) from a CUDA graph captured at the second step (cli/graph_step.py); the optimizer stays eager.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from ..nn import ModelConfig, MoELayer, MoEModel
from ..routing import ROUTERS, update_expert_biases
from . import UsageError, parallel
from .checkpoint import (CheckpointError, load_checkpoint, load_sharded, save_checkpoint, save_sharded,
                         load_newest_sharded, sharded_checkpoint_path)
from .data import builtin_corpus, random_batch, split_corpus, unigram_entropy
from .graph_step import GraphedStep
from .train_setup import check_args, sharded_save

__all__ = ["run"]


def _batch(data, args, gen, ranks):
    """This process's (inputs, targets): under torchrun, its slice of the global batch one generator draws."""
    n = args.batch_size * (ranks.world if ranks else 1)
    x, y = random_batch(data, n, args.seq_len, gen)
    if ranks is not None:
        x, y = (t[ranks.rank * args.batch_size:(ranks.rank + 1) * args.batch_size] for t in (x, y))
    return x, y


@torch.no_grad()
def evaluate(model, val, args, device, ctx, ranks=None) -> float:
    """The mean validation loss over --eval-batches fixed batches (over every rank's slice under torchrun)."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(args.eval_batches):
        x, y = _batch(val, args, gen, ranks)
        with ctx():
            logits, _, _ = model(x.to(device))
        total += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())
    model.train()
    if ranks is not None:
        total = ranks.mean(total)
    return float(total) / args.eval_batches


def _train_state(model, opt, step: int, gen, cfg, sharded: bool):
    """What a checkpoint holds; in a sharded one the state dicts come from torch.distributed.checkpoint's helpers
    (DTensor shards under torchrun) and the config is a JSON string."""
    if not sharded:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "generator": gen.get_state(), "config": cfg.to_dict()}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd, "train": {"step": step, "generator": gen.get_state(),
                                                      "config": json.dumps(cfg.to_dict(), sort_keys=True)}}


# How a run computes, not what its model is: a checkpoint resumes under other values of these.
EXECUTION = {"token_rounding", "rounding_tile"}
EXECUTION_EXPERTS = {"checkpoint", "backend", "precision", "fp8_weight_cache", "chunk_tokens", "index_method"}


def _meaning(d: dict) -> dict:
    """A config's fields that make the model what it is (its shape, routing and activation)."""
    out = {k: v for k, v in d.items() if k not in EXECUTION and k != "experts"}
    out.update({f"experts.{k}": v for k, v in d["experts"].items() if k not in EXECUTION_EXPERTS})
    return out


def _same_config(saved, cfg: ModelConfig) -> None:
    """UsageError unless the checkpoint's model is the flags' (fields added since it was saved: their defaults;
    execution choices such as the kernels, the checkpoint policy or token rounding may differ); it names the
    fields that differ."""
    try:
        saved = ModelConfig.from_dict(saved).to_dict()
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise UsageError(f"--resume: the checkpoint's config is not one this version reads ({e})") from None
    old, new = _meaning(saved), _meaning(cfg.to_dict())
    differ = [f"{k} (checkpoint {old.get(k)!r}, flags {new.get(k)!r})" for k in sorted(set(old) | set(new))
              if old.get(k) != new.get(k)]
    if differ:
        raise UsageError(f"--resume: the checkpoint is of another model: {'; '.join(differ)}")


def _check_single_file(ck) -> None:
    """UsageError unless a checksummed checkpoint holds what this version writes."""
    missing = [k for k in ("model", "optimizer", "step", "generator", "config")
               if not isinstance(ck, dict) or k not in ck]
    if missing:
        raise UsageError(f"--resume: the checkpoint lacks {', '.join(missing)}: not a moeblaze train checkpoint")
    if isinstance(ck["step"], bool) or not isinstance(ck["step"], int) or ck["step"] < 0:
        raise UsageError(f"--resume: the checkpoint's step is {ck['step']!r}, not a step count")


def _load_or_refuse(what: str, load) -> None:
    """load(), with a state that does not fit the model refused in one line (a tensor of another shape, a missing
    or extra entry)."""
    try:
        load()
    except (RuntimeError, KeyError, ValueError) as e:
        raise UsageError(f"--resume: the checkpoint's {what} does not fit: {str(e).splitlines()[0][:300]}") from None


def _check_shapes(saved: dict, current: dict) -> None:
    """UsageError naming the first tensor of the checkpoint whose shape is not the model's, with both shapes."""
    for name, t in current.items():
        v = saved.get(name) if isinstance(saved, dict) else None
        if isinstance(v, torch.Tensor) and v.shape != t.shape:
            raise UsageError(f"--resume: the checkpoint's {name} has shape {tuple(v.shape)}, the model's "
                             f"{tuple(t.shape)}")


def _resume(args, model, opt, gen, cfg, device, ranks) -> int:
    """The step of the checkpoint at --save, loaded into model, opt and gen (SystemExit if it can't be)."""
    if not sharded_save(args.save, ranks is not None):
        try:
            ck = load_checkpoint(args.save, map_location=device)
        except CheckpointError as e:
            raise SystemExit(f"--resume: {e}") from None
        _check_single_file(ck)
        _same_config(ck["config"], cfg)
        _check_shapes(ck["model"], model.state_dict())
        _load_or_refuse("model", lambda: model.load_state_dict(ck["model"]))
        _load_or_refuse("optimizer state", lambda: opt.load_state_dict(ck["optimizer"]))
        gen.set_state(ck["generator"].cpu())
        return ck["step"]
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _train_state(model, opt, 0, gen, cfg, True)
    state["train"]["config"] = ""
    rank = ranks.rank if ranks else 0
    try:  # the config first, alone: a checkpoint of another shape is refused by name before any tensor is read
        folder = load_newest_sharded(args.save, {"train": state["train"]}, rank)
    except CheckpointError as e:
        raise SystemExit(f"--resume: {e}") from None
    if folder != args.save.rstrip("/" + os.sep):
        if rank == 0:
            print(f"--resume: reading {folder} (left by a save that was stopped before it finished)")
    try:
        _same_config(json.loads(state["train"]["config"]), cfg)
        load_sharded(folder, state, rank)
    except CheckpointError as e:
        raise SystemExit(f"--resume: {e}") from None
    _load_or_refuse("state", lambda: set_state_dict(model, opt, model_state_dict=state["model"],
                                                    optim_state_dict=state["optimizer"]))
    gen.set_state(state["train"]["generator"].cpu())
    return int(state["train"]["step"])


def run(args) -> dict:
    train, val = split_corpus(builtin_corpus())
    cfg = check_args(args, len(val))
    ranks = parallel.start(args.device, args.ep) if parallel.launched() else None
    done = False
    try:
        out = _run(args, cfg, train, val, ranks)
        done = True
        return out
    finally:
        if ranks is not None:
            parallel.finish(done)


def _experts_path(cfg) -> str:
    """Which code computes the experts on the CPU, as the recipe resolves there."""
    from ..config import INTERPRET
    if cfg.experts.backend in ("reference", "auto"):
        return "the PyTorch reference (the Triton kernels run with --device cuda)"
    return "the Triton kernels under the interpreter" if INTERPRET else "the Triton kernels"


def _run(args, cfg, train, val, ranks) -> dict:
    from tqdm import tqdm

    device = ranks.device if ranks else torch.device(args.device)
    main = ranks is None or ranks.main
    say = print if main else (lambda *a, **k: None)
    if device.type == "cpu" and (args.threads is not None or "OMP_NUM_THREADS" not in os.environ):
        torch.set_num_threads(args.threads or min(2, torch.get_num_threads()))  # torch's default: the usable cores
    torch.manual_seed(args.seed)
    entropy = unigram_entropy(torch.cat([train, val]))
    model = MoEModel(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    bf16 = args.dtype == "bfloat16"
    if args.compile:
        for block in model.blocks:
            block.compile()
    if ranks is not None:
        parallel.parallelize_model(model, ranks, args.ep_dispatch, args.capacity_factor, args.on_overflow,
                                   args.batch_size * args.seq_len, cfg.top_k, bf16, args.fsdp_keep_gathered,
                                   units=args.fsdp_units, reduce_bf16=args.fsdp_reduce_dtype == "bfloat16")
    biased = ROUTERS[cfg.router].get("expert_bias", False)  # routers to update after each step (no walk otherwise)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)  # one kernel for every parameter (DTensors too; on the CPU 6x the loop's speed)
    gen = torch.Generator().manual_seed(args.seed)
    step = saved_step = 0
    bench = args.bench_steps > 0
    save = "" if bench else args.save
    sharded = bool(save) and sharded_save(save, ranks is not None)
    found = (sharded_checkpoint_path(save) is not None) if sharded else os.path.exists(save)
    if args.resume and not found:
        say(f"--resume: no checkpoint at {save}; starting from step 0")
    elif args.resume:
        step = saved_step = _resume(args, model, opt, gen, cfg, device, ranks)
        say(f"resumed from {save} at step {step}")
        if step >= args.steps:
            say(f"--resume: the checkpoint is at step {step}, not before --steps {args.steps}: nothing to train")
    ctx = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext
    world = ranks.world if ranks else 1
    layout = "" if ranks is None else f", {world} processes (efsdp {world // ranks.ep} x ep {ranks.ep}" + (
        f", {args.ep_dispatch} dispatch)" if ranks.ep > 1 else ")")
    say(f"moeblaze train: {n_params / 1e6:.2f}M parameters, {cfg.n_layers} MoE blocks x {cfg.num_experts} experts "
        f"(top-{cfg.top_k}, {cfg.activation}), corpus {len(train) + len(val):,} bytes, device {device.type}{layout}"
        + (f", {torch.get_num_threads()} CPU thread(s)"
           + (f" (OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']})" if "OMP_WAIT_POLICY" in os.environ else "")
           + f", experts on {_experts_path(cfg)}"
           if device.type == "cpu" else ""))
    say(f"unigram entropy of the corpus: {entropy:.3f} nats/byte (a model that ignores context)")
    last = args.bench_warmup + args.bench_steps if bench else args.steps

    def lr_at(s: int) -> float:
        warm = max(1, last // 20)
        if s < warm:
            return args.lr * (s + 1) / warm
        return args.lr * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, last - warm)))

    def clip():
        if ranks is None:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        from ..distributed import clip_grad_norm_
        return clip_grad_norm_(model.parameters(), 1.0)

    def train_step(x, y):
        with ctx():
            logits, aux, z = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        total = loss + args.aux_loss_coef * aux + args.z_loss_coef * z
        opt.zero_grad(set_to_none=True)
        (total / world).backward()  # under FSDP2 every unit sums: the gradient of the global mean (distributed.fsdp)
        return loss, aux, total

    graphed = GraphedStep(lambda x, y: (*train_step(x, y), clip())) if args.cuda_graph else None

    def validate() -> float:
        v = parallel.until_no_overflow(ranks, lambda: evaluate(model, val, args, device, ctx, ranks), log, model)
        if graphed is not None:  # the graph runs no FSDP2 hooks: what evaluation left gathered would go stale
            parallel.reshard(model)
        return v

    val_loss = float("nan")
    first_bad = torch.full((), -1, dtype=torch.long, device=device)  # the first step whose loss was not finite
    bar = tqdm(total=max(last, step), initial=step, desc="bench" if bench else "train", dynamic_ncols=True,
               disable=not main)
    log = bar.write if main else (lambda *a, **k: None)
    timer = parallel.StepTimer(device) if bench else None
    t_last, tokens = time.perf_counter(), 0
    loss = torch.full((), float("nan"), device=device)  # the last step's training loss (none when nothing trains)
    losses, norms, loads, pair_shares, evals, first_logged = [], [], [], [], [], step + 1
    moe_layers = [m for m in model.modules() if isinstance(m, MoELayer)] if args.loss_log else []
    for m in moe_layers:
        m.track_load = True
    # capacity dispatch under --on-overflow drop: each EP layer's count of the rows this rank dropped
    droppers = [m for m in model.modules() if getattr(m, "dropped_rows", None) is not None]
    drops, dropped_total = [], torch.zeros((), dtype=torch.int64, device=device)
    while step < last:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = _batch(train, args, gen, ranks)
        x, y = x.to(device), y.to(device)
        if timer is not None and step >= args.bench_warmup:
            timer.start()
        if graphed is not None:
            loss, aux, total, grad_norm = graphed(x, y)
        else:
            loss, aux, total = parallel.until_no_overflow(ranks, functools.partial(train_step, x, y), log, model)
            grad_norm = clip()
        opt.step()
        if biased:
            update_expert_biases(model)  # the loads summed over every rank under torchrun
        if timer is not None and step >= args.bench_warmup:
            timer.stop()
        step += 1
        if droppers:
            dropped = torch.stack([m.dropped_rows for m in droppers]).sum()
            for m in droppers:
                m.dropped_rows.zero_()
            dropped_total += dropped
            if args.loss_log:
                drops.append(ranks.sum(dropped) if ranks else dropped)
        if args.loss_log:  # kept on the device, read once at the end
            losses.append(ranks.mean(loss.detach()) if ranks else loss.detach())
            norms.append(grad_norm.detach().float())  # the global norm: the same on every rank
            if moe_layers:  # each MoE layer's max / mean expert load over this step's pairs (all ranks')
                load = torch.stack([m.routed_load for m in moe_layers]).float()
                load = ranks.sum(load) if ranks else load
                loads.append(load.amax(1) / load.mean(1).clamp(min=1e-9))
                if cfg.token_rounding:  # the pairs each layer computed, per top-k pair (rounding drops and adds)
                    pair_shares.append(load.sum(1) / (x.numel() * world * cfg.top_k))
                for m in moe_layers:
                    m.routed_load.zero_()
        tokens += x.numel()
        bar.update(1)
        first_bad = torch.where((first_bad < 0) & ~torch.isfinite(total.detach()), step, first_bad)
        evaluate_now = not bench and (step % args.eval_every == 0 or step == last)
        save_now = bool(save) and (step % args.save_every == 0 or step == last)
        if step % 10 == 0 or evaluate_now or save_now or step == last:  # a host read: check before anything is kept
            bad = int(ranks.max(first_bad) if ranks else first_bad)
            if bad >= 0:
                bar.close()
                kept = f"the checkpoint at {save} (step {saved_step}) is left as it was" if saved_step else \
                    "no checkpoint was written"
                raise SystemExit(f"non-finite training loss at step {bad}: stopped at step {step}; {kept}")
        if step % 10 == 0 or step == last:
            shown = ranks.mean(torch.stack([loss.detach(), aux.detach()])) if ranks else torch.stack([loss, aux])
            now = time.perf_counter()
            bar.set_postfix(loss=f"{shown[0].item():.3f}", aux=f"{shown[1].item() / cfg.n_layers:.3f}",
                            tok_s=f"{tokens * world / (now - t_last):,.0f}")
            t_last, tokens = now, 0
        if evaluate_now:
            val_loss = validate()
            shown = float(ranks.mean(loss.detach())) if ranks else loss.item()
            log(f"step {step}: train loss {shown:.3f}, val loss {val_loss:.3f} nats/byte")
            evals.append((step, val_loss))
        if save_now:
            state = _train_state(model, opt, step, gen, cfg, sharded)
            if sharded:
                save_sharded(save, state, ranks.rank if ranks else 0)
            else:
                save_checkpoint(save, state)
            saved_step = step
    bar.close()
    if saved_step:
        say(f"checkpoint of step {saved_step} saved to {save} (--resume continues from it)")
    if args.loss_log and main:
        with open(args.loss_log, "w") as f:
            loss_rows = torch.stack(losses).tolist() if losses else []
            norm_rows = torch.stack(norms).tolist() if norms else []
            load_rows = torch.stack(loads).tolist() if loads else [None] * len(loss_rows)
            drop_rows = torch.stack(drops).tolist() if drops else [None] * len(loss_rows)
            share_rows = torch.stack(pair_shares).tolist() if pair_shares else [None] * len(loss_rows)
            for i, (v, gn, ld, dr, sh) in enumerate(zip(loss_rows, norm_rows, load_rows, drop_rows, share_rows)):
                f.write(json.dumps({"step": first_logged + i, "loss": float(v), "grad_norm": round(float(gn), 5),
                                    **({"load_max_mean": [round(u, 4) for u in ld]} if ld is not None else {}),
                                    **({"pairs_per_topk": [round(u, 4) for u in sh]} if sh is not None else {}),
                                    **({"dropped_rows": int(dr)} if dr is not None else {})})
                        + "\n")
            f.writelines(json.dumps({"step": s, "val_loss": v}) + "\n" for s, v in evals)
    if droppers:  # every rank takes part in the sum; the main one says it
        n = int(ranks.sum(dropped_total) if ranks else dropped_total)
        log(f"capacity dispatch dropped {n:,} rows over the run (--on-overflow drop; --loss-log has them per step)")
    final_loss = float(ranks.mean(loss.detach()) if ranks else loss.detach())
    if bench:
        batch = (lambda: tuple(t.to(device) for t in _batch(train, args, gen, ranks)))
        profiled = ((lambda: graphed(*batch()), opt.step) if graphed is not None else
                    (lambda: train_step(*batch()), lambda: (clip(), opt.step())))
        row = parallel.bench_row(args, cfg, ranks, timer, final_loss, n_params,
                                 profiled if args.bench_profile else None)
        if main:
            say(parallel.format_row(row))
        return row
    if math.isnan(val_loss):
        val_loss = validate()
    say(f"final validation loss {val_loss:.5f} nats/byte vs unigram entropy {entropy:.3f} "
        f"({'learned' if val_loss < entropy else 'did NOT beat'} context: {entropy - val_loss:+.3f} nats/byte)")
    return {"val_loss": val_loss, "unigram_entropy": entropy, "step": step, "train_loss": final_loss}
