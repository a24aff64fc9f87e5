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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..nn import ModelConfig, MoELayer, MoEModel
from ..routing import update_expert_biases
from ..distributed.plan import CapacityOverflow
from . import RunError, parallel
from .checkpoint import (save_checkpoint, save_sharded,
                         sharded_checkpoint_path)
from .data import builtin_corpus, random_batch, split_corpus, unigram_entropy
from .graph_step import GraphedStep
from .resume import resume, train_state
from .train_config import Schedule, TrainConfig
from .train_setup import check_run, experts_path, precision_note, sharded_save

__all__ = ["run"]


def _batch(data, sched: Schedule, gen, ranks):
    """This process's (inputs, targets): under torchrun, its slice of the global batch one generator draws."""
    n = sched.batch_size * (ranks.world if ranks else 1)
    x, y = random_batch(data, n, sched.seq_len, gen)
    if ranks is not None:
        x, y = (t[ranks.rank * sched.batch_size:(ranks.rank + 1) * sched.batch_size] for t in (x, y))
    return x, y


@torch.no_grad()
def evaluate(model, val, sched: Schedule, device, ctx, ranks=None) -> float:
    """The mean validation loss over --eval-batches fixed batches (over every rank's slice under torchrun)."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(sched.eval_batches):
        x, y = _batch(val, sched, gen, ranks)
        with ctx():
            logits, _, _ = model(x.to(device))
        total += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())
    model.train()
    if ranks is not None:
        total = ranks.mean(total)
    return float(total) / sched.eval_batches


def run(config: TrainConfig) -> dict:
    """Train (or time, under --bench-steps) the run `config` says (train_flags.check_flags builds it from flags)."""
    train, val = split_corpus(builtin_corpus())
    config, note = check_run(config, len(val))
    ranks = parallel.start(config.machine.device, config.parallel.ep) if parallel.launched() else None
    done = False
    try:
        out = _run(config, note, train, val, ranks)
        done = True
        return out
    except CapacityOverflow as e:  # said on every rank in one line (the default --on-overflow rerun never raises it)
        raise RunError(str(e)) from None
    finally:
        if ranks is not None:
            parallel.finish(done)


def _run(config: TrainConfig, note: str, train, val, ranks) -> dict:
    """Set-up, the training loop, the end (the loss log, the final validation or the benchmark row)."""
    run = _set_up(config, note, train, val, ranks)
    graphed = GraphedStep(lambda x, y: (*run.train_step(x, y), run.clip())) if config.machine.cuda_graph else None
    record = _Record(run)
    timer = parallel.StepTimer(run.device) if run.bench else None
    loss, val_loss, evals, saved_step = _loop(run, train, val, graphed, record, timer)
    if saved_step:
        run.say(f"checkpoint of step {saved_step} saved to {run.save} (--resume continues from it)")
    if config.outputs.loss_log and run.main:
        record.write(config.outputs.loss_log, evals)
    record.say_drops(run)
    final_loss = float(ranks.mean(loss.detach()) if ranks else loss.detach())
    if run.bench:
        def batch():
            return tuple(t.to(run.device) for t in _batch(train, config.schedule, run.gen, ranks))
        profiled = ((lambda: graphed(*batch()), run.opt.step) if graphed is not None else
                    (lambda: run.train_step(*batch()), lambda: (run.clip(), run.opt.step())))
        row = parallel.bench_row(config, ranks, timer, final_loss, run.n_params,
                                 profiled if config.bench.profile else None)
        run.say(parallel.format_row(row))
        return row
    if math.isnan(val_loss):
        val_loss = _validate(run, val, graphed, print if run.main else _quiet)
    run.say(f"final validation loss {val_loss:.5f} nats/byte vs unigram entropy {run.entropy:.3f} "
            f"({'learned' if val_loss < run.entropy else 'did NOT beat'} context: {run.entropy - val_loss:+.3f} "
            "nats/byte)")
    return {"val_loss": val_loss, "unigram_entropy": run.entropy, "step": run.end_step, "train_loss": final_loss}


def _quiet(*_args, **_kwargs) -> None:
    """What a rank other than the main one prints."""


@dataclass
class _Run:
    """What set-up makes for the loop and the end: the run's model, optimizer, data generator and schedule."""
    config: TrainConfig
    ranks: object  # parallel.Ranks under torchrun, else None
    device: torch.device
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    gen: torch.Generator
    ctx: object  # the compute context: CUDA autocast to bf16, or none
    save: str  # the checkpoint path ("" for none: --save "", or a benchmark run)
    sharded: bool
    n_params: int
    entropy: float
    step: int = 0  # the first step to train (the checkpoint's under --resume)
    end_step: int = 0  # the step the loop reached

    @property
    def cfg(self) -> ModelConfig:
        return self.config.model

    @property
    def bench(self) -> bool:
        return self.config.bench.steps > 0

    @property
    def last(self) -> int:
        bench = self.config.bench
        return bench.warmup + bench.steps if self.bench else self.config.schedule.steps

    @property
    def world(self) -> int:
        return self.ranks.world if self.ranks else 1

    @property
    def main(self) -> bool:
        return self.ranks is None or self.ranks.main

    def evaluates_at(self, step: int) -> bool:
        """Whether the run evaluates after `step` (every --eval-every steps and at the end; never when timing)."""
        return not self.bench and (step % self.config.schedule.eval_every == 0 or step == self.last)

    def saves_at(self, step: int) -> bool:
        """Whether the run saves its checkpoint after `step` (every --save-every steps and at the end)."""
        return bool(self.save) and (step % self.config.outputs.save_every == 0 or step == self.last)

    def say(self, text: str) -> None:
        if self.main:
            print(text)

    def lr_at(self, s: int) -> float:
        """Linear warm-up over a 20th of the run, then cosine to 0."""
        last, lr = self.last, self.config.schedule.lr
        warm = max(1, last // 20)
        if s < warm:
            return lr * (s + 1) / warm
        return lr * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, last - warm)))

    def clip(self):
        if self.ranks is None:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        from ..distributed import clip_grad_norm_
        return clip_grad_norm_(self.model.parameters(), 1.0)

    def train_step(self, x, y):
        """(loss, aux, total) of forward and backward on this process's batch."""
        with self.ctx():
            logits, aux, z = self.model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        sched = self.config.schedule
        total = loss + sched.aux_loss_coef * aux + sched.z_loss_coef * z
        self.opt.zero_grad(set_to_none=True)
        (total / self.world).backward()  # under FSDP2 every unit sums: the gradient of the global mean
        return loss, aux, total


def _set_up(config: TrainConfig, note: str, train, val, ranks) -> _Run:
    """The model (compiled, parallelized under torchrun), its optimizer, the data generator, the state of --resume,
    and the run's first lines."""
    cfg, machine, sched = config.model, config.machine, config.schedule
    device = ranks.device if ranks else torch.device(machine.device)
    if device.type == "cpu" and (machine.threads is not None or "OMP_NUM_THREADS" not in os.environ):
        torch.set_num_threads(machine.threads or min(2, torch.get_num_threads()))  # torch's default: the usable cores
    torch.manual_seed(sched.seed)
    model = MoEModel(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if machine.compile:
        for block in model.blocks:
            block.compile()
    if ranks is not None:
        parallel.parallelize_model(model, ranks, config)
    opt = torch.optim.AdamW(model.parameters(), lr=sched.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)  # one kernel for every parameter (DTensors too; on the CPU 6x the loop's speed)
    save = "" if config.bench.steps > 0 else config.outputs.save
    run = _Run(config, ranks, device, model, opt, torch.Generator().manual_seed(sched.seed),
               functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16) if machine.bf16
               else contextlib.nullcontext,
               save, bool(save) and sharded_save(save, ranks is not None), n_params,
               unigram_entropy(torch.cat([train, val])))
    _resume_if_asked(run)
    run.say(_header(run, len(train) + len(val)))
    if note:
        run.say(f"layout by rule: {note}")
    if fp8_note := precision_note(config):
        run.say(fp8_note)
    run.say(f"unigram entropy of the corpus: {run.entropy:.3f} nats/byte (a model that ignores context)")
    return run


def _resume_if_asked(run: _Run) -> None:
    """Under --resume, the checkpoint at --save loaded (where there is one: rank 0's view decides, every rank
    resumes or none, checkpoint.load_newest_sharded)."""
    if not run.config.outputs.resume:
        return
    save = run.save
    found = [(sharded_checkpoint_path(save) is not None) if run.sharded else os.path.exists(save)]
    if run.ranks is not None:
        torch.distributed.broadcast_object_list(found, src=0)
    if not found[0]:
        run.say(f"--resume: no checkpoint at {save}; starting from step 0")
        return
    run.step = resume(save, run.model, run.opt, run.gen, run.cfg, run.device, run.ranks)
    run.say(f"resumed from {save} at step {run.step}")
    steps = run.config.schedule.steps
    if run.step >= steps:
        run.say(f"--resume: the checkpoint is at step {run.step}, not before --steps {steps}: nothing to train")


def _header(run: _Run, corpus: int) -> str:
    """The run's first line: the model, the corpus, the device and the layout."""
    cfg, ranks, par = run.cfg, run.ranks, run.config.parallel
    layout = "" if ranks is None else f", {run.world} processes (efsdp {run.world // ranks.ep} x ep {ranks.ep}" + (
        f", {par.ep_config.dispatch} dispatch, {par.ep_config.transport} transport)" if ranks.ep > 1 else ")")
    cpu = (f", {torch.get_num_threads()} CPU thread(s)"
           + (f" (OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']})" if "OMP_WAIT_POLICY" in os.environ else "")
           + f", experts on {experts_path(cfg, 1 if ranks is None else ranks.ep)}")
    return (f"moeblaze train: {run.n_params / 1e6:.2f}M parameters, {cfg.n_layers - cfg.dense_layers} MoE blocks x "
            f"{cfg.num_experts} experts (top-{cfg.top_k}, {cfg.activation})"
            + (f" after {cfg.dense_layers} dense block(s)" if cfg.dense_layers else "")
            + f", corpus {corpus:,} bytes, device {run.device.type}{layout}"
            + (cpu if run.device.type == "cpu" else ""))


def _validate(run: _Run, val, graphed, log) -> float:
    v = parallel.until_no_overflow(run.ranks, lambda: evaluate(run.model, val, run.config.schedule, run.device,
                                                               run.ctx, run.ranks), log, run.model)
    if graphed is not None:  # the graph runs no FSDP2 hooks: what evaluation left gathered would go stale
        parallel.reshard(run.model)
    return v


def _loop(run: _Run, train, val, graphed, record, timer):
    """The training steps from run.step to run.last, with evaluation, checkpoints and a check of the loss at every
    host read: (the last step's loss, the last validation loss (NaN if none), the evaluations, the step of the
    checkpoint this run wrote last (0: none))."""
    from tqdm import tqdm

    sched, ranks, device, step = run.config.schedule, run.ranks, run.device, run.step
    warmup = run.config.bench.warmup
    val_loss, evals, saved_step, wrote = float("nan"), [], step, False  # saved_step: the resumed one's at first
    first_bad = torch.full((), -1, dtype=torch.long, device=device)  # the first step whose loss was not finite
    bar = tqdm(total=max(run.last, step), initial=step, desc="bench" if run.bench else "train", dynamic_ncols=True,
               disable=not run.main)
    log = bar.write if run.main else _quiet  # (what the other ranks would say, the main one says)
    t_last, tokens = time.perf_counter(), 0
    loss = torch.full((), float("nan"), device=device)  # the last step's training loss (none when nothing trains)
    while step < run.last:
        x, y = (t.to(device) for t in _batch(train, sched, run.gen, ranks))
        loss, aux, total, grad_norm = _step(run, step, x, y, graphed, log, timer if step >= warmup else None)
        step += 1
        record.step(loss, grad_norm, x)
        tokens += x.numel()
        bar.update(1)
        first_bad = torch.where((first_bad < 0) & ~torch.isfinite(total.detach()), step, first_bad)
        evaluate_now, save_now = run.evaluates_at(step), run.saves_at(step)
        shown = step % 10 == 0 or step == run.last  # the progress bar's host read
        if shown or evaluate_now or save_now:  # a host read: check before keeping
            _stop_if_diverged(run, first_bad, step, saved_step, bar)
        if shown:
            t_last, tokens = _show(run, bar, loss, aux, tokens, t_last), 0
        if evaluate_now:
            val_loss = _validate(run, val, graphed, log)
            log(f"step {step}: train loss {float(ranks.mean(loss.detach()) if ranks else loss):.3f}, val loss "
                f"{val_loss:.3f} nats/byte")
            evals.append((step, val_loss))
        if save_now:
            _save(run, step)
            saved_step, wrote = step, True
    bar.close()
    run.end_step = step
    return loss, val_loss, evals, saved_step if wrote else 0


def _step(run: _Run, step: int, x, y, graphed, log, timer):
    """Optimizer step `step` on (x, y), timed by timer where one is given: (loss, aux, total, the gradient norm
    before clipping)."""
    for g in run.opt.param_groups:
        g["lr"] = run.lr_at(step)
    if timer is not None:
        timer.start()
    if graphed is not None:
        loss, aux, total, grad_norm = graphed(x, y)
    else:
        loss, aux, total = parallel.until_no_overflow(run.ranks, functools.partial(run.train_step, x, y), log,
                                                      run.model)
        grad_norm = run.clip()
    run.opt.step()
    if run.cfg.router.expert_bias:
        update_expert_biases(run.model)  # the loads summed over every rank under torchrun
    if timer is not None:
        timer.stop()
    return loss, aux, total, grad_norm


def _show(run: _Run, bar, loss, aux, tokens: int, t_last: float) -> float:
    """The progress bar's loss, balancing loss and tokens/s since t_last (a host read); the time now."""
    shown = run.ranks.mean(torch.stack([loss.detach(), aux.detach()])) if run.ranks else torch.stack([loss, aux])
    now = time.perf_counter()
    bar.set_postfix(loss=f"{shown[0].item():.3f}", aux=f"{shown[1].item() / run.cfg.n_layers:.3f}",
                    tok_s=f"{tokens * run.world / (now - t_last):,.0f}")
    return now


def _stop_if_diverged(run: _Run, first_bad, step: int, saved_step: int, bar) -> None:
    """SystemExit naming the first step whose training loss was not finite, if any (a host read)."""
    bad = int(run.ranks.max(first_bad) if run.ranks else first_bad)
    if bad >= 0:
        bar.close()
        kept = (f"the checkpoint at {run.save} (step {saved_step}) is left as it was" if saved_step else
                "no checkpoint was written")
        raise SystemExit(f"non-finite training loss at step {bad}: stopped at step {step}; {kept}")


def _save(run: _Run, step: int) -> None:
    state = train_state(run.model, run.opt, step, run.gen, run.cfg, run.sharded)
    if run.sharded:
        save_sharded(run.save, state, run.ranks.rank if run.ranks else 0)
    else:
        save_checkpoint(run.save, state)


class _Record:
    """What the run records every step, kept on the device and read once at the end: --loss-log's rows (the
    training loss, the global gradient norm, each MoE layer's max / mean expert load, with token rounding the pairs
    computed per top-k pair) and the rows capacity dispatch dropped (--on-overflow drop)."""

    def __init__(self, run: _Run):
        self.run, self.first = run, run.step + 1
        self.losses, self.norms, self.loads, self.shares, self.drops = [], [], [], [], []
        self.moe_layers = ([m for m in run.model.modules() if isinstance(m, MoELayer)] if run.config.outputs.loss_log
                           else [])
        for m in self.moe_layers:
            m.track_load = True
        self.droppers = [m for m in run.model.modules() if getattr(m, "dropped_rows", None) is not None]
        self.dropped = torch.zeros((), dtype=torch.int64, device=run.device)

    def step(self, loss, grad_norm, x) -> None:
        ranks, log = self.run.ranks, bool(self.run.config.outputs.loss_log)
        if self.droppers:
            dropped = torch.stack([m.dropped_rows for m in self.droppers]).sum()
            for m in self.droppers:
                m.dropped_rows.zero_()
            self.dropped += dropped
            if log:
                self.drops.append(ranks.sum(dropped) if ranks else dropped)
        if not log:
            return
        self.losses.append(ranks.mean(loss.detach()) if ranks else loss.detach())
        self.norms.append(grad_norm.detach().float())  # the global norm: the same on every rank
        if self.moe_layers:  # each MoE layer's max / mean expert load over this step's pairs (all ranks')
            load = torch.stack([m.routed_load for m in self.moe_layers]).float()
            load = ranks.sum(load) if ranks else load
            self.loads.append(load.amax(1) / load.mean(1).clamp(min=1e-9))
            if self.run.cfg.rounding is not None:  # the pairs each layer computed, per top-k pair
                self.shares.append(load.sum(1) / (x.numel() * self.run.world * self.run.cfg.top_k))
            for m in self.moe_layers:
                m.routed_load.zero_()

    def write(self, path: str, evals) -> None:
        """Every step's row, then every validation loss, as JSON lines."""
        def rows(kept, n):
            return torch.stack(kept).tolist() if kept else [None] * n
        loss_rows = rows(self.losses, 0)
        norm_rows = rows(self.norms, 0)
        n = len(loss_rows)
        with open(path, "w") as f:
            for i, (v, gn, ld, dr, sh) in enumerate(zip(loss_rows, norm_rows, rows(self.loads, n),
                                                         rows(self.drops, n), rows(self.shares, n))):
                f.write(json.dumps({"step": self.first + i, "loss": float(v), "grad_norm": round(float(gn), 5),
                                    **({"load_max_mean": [round(u, 4) for u in ld]} if ld is not None else {}),
                                    **({"pairs_per_topk": [round(u, 4) for u in sh]} if sh is not None else {}),
                                    **({"dropped_rows": int(dr)} if dr is not None else {})})
                        + "\n")
            f.writelines(json.dumps({"step": s, "val_loss": v}) + "\n" for s, v in evals)

    def say_drops(self, run: _Run) -> None:
        if self.droppers:  # every rank takes part in the sum; the main one says it
            n = int(run.ranks.sum(self.dropped) if run.ranks else self.dropped)
            if run.main:
                print(f"capacity dispatch dropped {n:,} rows over the run (--on-overflow drop; --loss-log has them "
                      "per step)")
