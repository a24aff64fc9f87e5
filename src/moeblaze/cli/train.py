"""`moeblaze train`: train the small MoE language model on the built-in corpus.

Every argument is checked before any work starts (a bad one exits with status 2 and one line, as argparse
does), including that the checkpoint location is writable. Checkpoints (model, optimizer, step, data-sampler
state, config) are written atomically with a checksum and verified on --resume (see cli/checkpoint.py).
--resume without a checkpoint at --save says so on one line and starts from step 0. A non-finite training
loss stops the run with an error naming the step, before anything is saved, so the last checkpoint is never
overwritten by a diverged state (the check rides on the run's existing host reads, every 10 steps and before
every evaluation and save, so it adds no host sync).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import time

import torch
import torch.nn.functional as F

from ..args import check_choice, check_int
from ..config import INTERPRET
from ..nn import ModelConfig, MoEModel
from ..reference import ACTIVATIONS
from . import UsageError
from .checkpoint import CheckpointError, load_checkpoint, probe_writable, save_checkpoint
from .data import builtin_corpus, random_batch, split_corpus, unigram_entropy


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ModelConfig()
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=d.max_seq_len)
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--n-layers", type=int, default=d.n_layers)
    p.add_argument("--n-heads", type=int, default=d.n_heads)
    p.add_argument("--num-experts", type=int, default=d.num_experts)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--d-expert", type=int, default=d.d_expert)
    p.add_argument("--activation", default=d.activation, choices=ACTIVATIONS)
    p.add_argument("--impl", default=d.impl, choices=("auto", "triton", "reference"))
    p.add_argument("--checkpoint-policy", default=d.checkpoint, choices=("preact", "recompute"))
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-loss-coef", type=float, default=1e-2)
    p.add_argument("--z-loss-coef", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--save", default="checkpoints/moeblaze.pt", help="checkpoint path ('' to disable)")
    p.add_argument("--save-every", type=int, default=250)
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint at --save (without one, say so and start from step 0)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype; bfloat16 runs under CUDA autocast")
    p.add_argument("--seed", type=int, default=0)


def check_args(args, val_len: int) -> ModelConfig:
    """The model config of the flags, after every flag is checked (UsageError naming the flag otherwise)."""
    try:
        for name in ("steps", "batch_size", "seq_len", "d_model", "n_layers", "n_heads", "num_experts", "top_k",
                     "d_expert", "eval_every", "eval_batches", "save_every"):
            check_int("--" + name.replace("_", "-"), getattr(args, name))
        check_int("--seed", args.seed, minimum=0)
        if args.seq_len > val_len - 2:
            raise ValueError(f"--seq-len must be at most {val_len - 2} (the held-out text's length - 2), "
                             f"got {args.seq_len}")
        if not (math.isfinite(args.lr) and args.lr > 0):
            raise ValueError(f"--lr must be a positive finite number, got {args.lr}")
        for name in ("aux_loss_coef", "z_loss_coef"):
            v = getattr(args, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v}")
        if args.top_k > args.num_experts:
            raise ValueError(f"--top-k must be <= --num-experts ({args.num_experts}), got {args.top_k}")
        if args.d_model % args.n_heads:
            raise ValueError(f"--d-model ({args.d_model}) must be divisible by --n-heads ({args.n_heads})")
        check_choice("--activation", args.activation, ACTIVATIONS)
        cfg = ModelConfig(max_seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers,
                          n_heads=args.n_heads, num_experts=args.num_experts, top_k=args.top_k,
                          d_expert=args.d_expert, activation=args.activation, impl=args.impl,
                          checkpoint=args.checkpoint_policy)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    if args.dtype == "bfloat16" and args.device != "cuda":
        raise UsageError("--dtype bfloat16 needs --device cuda")
    if args.impl == "triton" and args.device != "cuda" and not INTERPRET:
        raise UsageError("--impl triton needs --device cuda (or TRITON_INTERPRET=1 set before the command starts)")
    if args.resume and not args.save:
        raise UsageError("--resume needs a checkpoint path (--save)")
    if args.save:
        try:
            probe_writable(args.save)
        except CheckpointError as e:
            raise UsageError(f"--save: {e}") from None
    return cfg


@torch.no_grad()
def evaluate(model, val, args, device, ctx) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    total = 0.0
    for _ in range(args.eval_batches):
        x, y = random_batch(val, args.batch_size, args.seq_len, gen)
        with ctx():
            logits, _, _ = model(x.to(device))
        total += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten()).item()
    model.train()
    return total / args.eval_batches


def run(args) -> dict:
    from tqdm import tqdm

    train, val = split_corpus(builtin_corpus())
    cfg = check_args(args, len(val))
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    entropy = unigram_entropy(torch.cat([train, val]))
    model = MoEModel(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    step = saved_step = 0
    if args.resume and not os.path.exists(args.save):
        print(f"--resume: no checkpoint at {args.save}; starting from step 0")
    elif args.resume:
        try:
            ck = load_checkpoint(args.save, map_location=device)
        except CheckpointError as e:
            raise SystemExit(f"--resume: {e}") from None
        if ck["config"] != cfg.to_dict():
            raise SystemExit(f"--resume: checkpoint config {ck['config']} differs from the flags {cfg.to_dict()}")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        gen.set_state(ck["generator"].cpu())
        step = saved_step = ck["step"]
        print(f"resumed from {args.save} at step {step}")
        if step >= args.steps:
            print(f"--resume: the checkpoint is at step {step}, not before --steps {args.steps}: nothing to train")
    if args.dtype == "bfloat16":
        ctx = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16)
    else:
        ctx = contextlib.nullcontext
    n_params = sum(p.numel() for p in model.parameters())
    print(f"moeblaze train: {n_params / 1e6:.2f}M parameters, {cfg.n_layers} MoE blocks x {cfg.num_experts} experts "
          f"(top-{cfg.top_k}, {cfg.activation}), corpus {len(train) + len(val):,} bytes, device {device}")
    print(f"unigram entropy of the corpus: {entropy:.3f} nats/byte (a model that ignores context)")

    def lr_at(s: int) -> float:
        warm = max(1, args.steps // 20)
        if s < warm:
            return args.lr * (s + 1) / warm
        return args.lr * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, args.steps - warm)))

    val_loss = float("nan")
    first_bad = torch.full((), -1, dtype=torch.long, device=device)  # the first step whose loss was not finite
    bar = tqdm(total=max(args.steps, step), initial=step, desc="train", dynamic_ncols=True)
    t_last, tokens = time.perf_counter(), 0
    while step < args.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = random_batch(train, args.batch_size, args.seq_len, gen)
        x, y = x.to(device), y.to(device)
        with ctx():
            logits, aux, z = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        total = loss + args.aux_loss_coef * aux + args.z_loss_coef * z
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        bar.update(1)
        first_bad = torch.where((first_bad < 0) & ~torch.isfinite(total.detach()), step, first_bad)
        evaluate_now = step % args.eval_every == 0 or step == args.steps
        save_now = bool(args.save) and (step % args.save_every == 0 or step == args.steps)
        if step % 10 == 0 or evaluate_now or save_now:  # a host read: check the loss before anything is kept
            if (bad := int(first_bad)) >= 0:
                bar.close()
                kept = f"the checkpoint at {args.save} (step {saved_step}) is left as it was" if saved_step else \
                    "no checkpoint was written"
                raise SystemExit(f"non-finite training loss at step {bad}: stopped at step {step}; {kept}")
        if step % 10 == 0 or step == args.steps:
            now = time.perf_counter()
            bar.set_postfix(loss=f"{loss.item():.3f}", aux=f"{aux.item() / cfg.n_layers:.3f}",
                            tok_s=f"{tokens / (now - t_last):,.0f}")
            t_last, tokens = now, 0
        if evaluate_now:
            val_loss = evaluate(model, val, args, device, ctx)
            bar.write(f"step {step}: train loss {loss.item():.3f}, val loss {val_loss:.3f} nats/byte")
        if save_now:
            save_checkpoint(args.save, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                                        "generator": gen.get_state(), "config": cfg.to_dict()})
            saved_step = step
    bar.close()
    if math.isnan(val_loss):
        val_loss = evaluate(model, val, args, device, ctx)
    print(f"final validation loss {val_loss:.3f} nats/byte vs unigram entropy {entropy:.3f} "
          f"({'learned' if val_loss < entropy else 'did NOT beat'} context: {entropy - val_loss:+.3f} nats/byte)")
    return {"val_loss": val_loss, "unigram_entropy": entropy, "step": step}
