"""The checks of `moeblaze train` that ask the machine, after cli/train_flags.py built the run's config from the
flags alone: the device, the backend where the run's tensors will be, the processes torchrun started, the files the
run will write. A bad one exits with status 2 and one line naming the flag, before any work starts.

Memory: none beyond the config.
"""
from __future__ import annotations

import os

import torch

from ..env import INTERPRET
from ..distributed.ep import check_options
from ..experts.dispatch import choose
from . import UsageError, check_device, default_device, parallel
from .checkpoint import (CheckpointError, check_header, probe_writable, probe_writable_folder,
                         sharded_checkpoint_path)
from .graph_step import check_graphable
from .train_config import TrainConfig


def check_run(config: TrainConfig, val_len: int) -> tuple[TrainConfig, str]:
    """(config, note): the run after the machine's checks (UsageError naming the flag otherwise), with what the flags
    left open decided: the device, the checkpoint path, the parallel layout (the note says what the rule chose)."""
    dist_run = parallel.launched()
    machine, par, out = config.machine, config.parallel, config.outputs
    config = config.replace(
        outputs=dict(save=out.save if out.save is not None else
                     "checkpoints/moeblaze-sharded" if dist_run else "checkpoints/moeblaze.pt"),
        machine=dict(device=default_device(machine.device)))
    explicit = [f for f, on in (("--fsdp-keep-gathered", par.keep_gathered == "yes"),
                                ("--fsdp-reduce-dtype bfloat16", par.reduce_dtype == "bfloat16")) if on]
    if explicit and not dist_run:
        raise UsageError(f"{explicit[0]} sets FSDP2, which runs under torchrun (--nproc-per-node 1 or more)")
    config, note = parallel.choose_layout(config, dist_run)
    try:
        if config.schedule.seq_len > val_len - 2:
            raise ValueError(f"--seq-len must be at most {val_len - 2} (the held-out text's length - 2), "
                             f"got {config.schedule.seq_len}")
        if config.parallel.ep > 1:  # the recipe expert parallelism runs
            check_options(config.model.experts)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    _check_machine(config)
    _check_processes(config, dist_run)
    _probe_outputs(config, dist_run)
    return config, note


def _check_machine(config: TrainConfig) -> None:
    """UsageError unless the device runs what the run asks: graphs, compile, bf16, the backend."""
    machine, experts = config.machine, config.model.experts
    check_device(machine.device)
    if machine.cuda_graph:
        check_graphable(config)
    if machine.compile and machine.device != "cuda":
        raise UsageError("--compile needs --device cuda (the interpreter's kernels do not compile)")
    if machine.bf16 and machine.device != "cuda":
        raise UsageError("--dtype bfloat16 needs --device cuda")
    if experts.backend not in ("auto", "reference") and machine.device != "cuda" and not INTERPRET:
        raise UsageError(f"--backend {experts.backend} runs the kernels: it needs --device cuda (or TRITON_INTERPRET=1 "
                         "set before the command starts)")
    try:  # the backend where the run's tensors will be: what the layer itself would refuse at its first call
        choose(experts.backend, torch.device(machine.device))
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--backend {experts.backend}: {e}") from None


def _check_processes(config: TrainConfig, dist_run: bool) -> None:
    """UsageError unless the processes torchrun started (or not) run what the flags ask: FSDP2's flags under
    torchrun, --ep dividing the processes and the experts, expert parallelism on the kernels."""
    par, machine, experts = config.parallel, config.machine, config.model.experts
    if par.units != "blocks" and not dist_run:
        raise UsageError(f"--fsdp-units {par.units} sets FSDP2, which runs under torchrun (--nproc-per-node 1 or more)")
    if par.reduce_dtype != "float32" and not machine.bf16:
        raise UsageError("--fsdp-reduce-dtype bfloat16 needs --dtype bfloat16 (float32 parameters reduce in float32)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist_run and world % par.ep == 0:  # (an --ep that doesn't divide the processes: refused below)
        from ..distributed.fsdp import check_weight_cache

        try:
            check_weight_cache(experts, world // par.ep, par.ep)
        except ValueError as e:
            raise UsageError(f"--fp8-weight-cache: {e}") from None
    if par.ep > 1:
        if not dist_run:
            raise UsageError(f"--ep {par.ep} needs {par.ep} or more processes: run under torchrun "
                             "--nproc-per-node N")
        if world % par.ep:
            raise UsageError(f"--ep {par.ep} must divide the number of processes ({world})")
        if config.model.num_experts % par.ep:
            raise UsageError(f"--ep {par.ep} must divide --num-experts ({config.model.num_experts})")
        if experts.backend == "reference":
            raise UsageError("--ep runs the experts on the Triton kernels, not --backend reference")
        if machine.device != "cuda" and not INTERPRET:
            raise UsageError("--ep runs the experts on the Triton kernels: --device cuda, or on the CPU "
                             "TRITON_INTERPRET=1 set before the command starts")


def _probe_outputs(config: TrainConfig, dist_run: bool) -> None:
    """UsageError unless every file the run will write can be written: the checkpoint, the loss log, the trace,
    the results file (a path that fails only when first written loses the run's work). A refusal takes away the
    folders the probes before it made."""
    missing = [d for d in _missing_folders(config) if not os.path.exists(d)]
    try:
        _probe_each(config, dist_run)
    except UsageError:
        for d in sorted(missing, key=len, reverse=True):  # deepest first; only those still empty
            if os.path.isdir(d) and not os.listdir(d):
                os.rmdir(d)
        raise


def _missing_folders(config: TrainConfig) -> list[str]:
    """Every folder on the way to an output path (the probes make those missing)."""
    out, bench = [], config.bench
    for path in (config.outputs.save, config.outputs.loss_log, bench.trace,
                 bench.results and os.path.join(bench.results, "x")):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        while folder and os.path.dirname(folder) != folder:
            out.append(folder)
            folder = os.path.dirname(folder)
    return out


def _probe_each(config: TrainConfig, dist_run: bool) -> None:
    out, bench = config.outputs, config.bench
    if out.overwrite and not out.save:
        raise UsageError("--overwrite replaces the checkpoint at --save, and --save '' saves none: leave one out")
    if out.save and not bench.steps:
        _check_existing(out, dist_run)
        try:
            (probe_writable_folder if sharded_save(out.save, dist_run) else probe_writable)(out.save)
        except CheckpointError as e:
            raise UsageError(f"--save: {e}") from None
    outputs = [("--loss-log", out.loss_log, "loss log"), ("--bench-trace", bench.trace, "trace")]
    if bench.steps:  # a folder: the results file goes in it
        outputs.append(("--results", bench.results and os.path.join(bench.results, "results.probe"), "results file"))
    for flag, path, what in outputs:
        if path:
            try:
                probe_writable(path, what)
            except CheckpointError as e:
                raise UsageError(f"{flag}: {e}") from None


def _check_existing(out, dist_run: bool) -> None:
    """A new run never replaces a checkpoint unasked (UsageError unless --resume or --overwrite says what to do with
    the one at --save); --resume's file must start as a checkpoint does, found before any work."""
    sharded = sharded_checkpoint_path(out.save)
    there = sharded is not None or os.path.isfile(out.save)
    if os.path.isfile(out.save) and sharded is None and not out.resume:  # a checkpoint only if it starts as one
        # (under --resume the header check below says so, as --resume's)
        try:
            check_header(out.save)
        except CheckpointError:
            raise UsageError(f"--save: {out.save} is a file but not a moeblaze checkpoint: moeblaze replaces only "
                             "its own checkpoints; give another path") from None
    if out.overwrite and not there:
        raise UsageError(f"--overwrite: there is no checkpoint at {out.save} to replace; leave --overwrite out")
    if there and not (out.resume or out.overwrite):
        raise UsageError(f"--save: {out.save} holds a checkpoint already: --resume continues it, --overwrite "
                         "replaces it, --save PATH writes another")
    if out.resume and os.path.isfile(out.save) and not dist_run and sharded is None:
        try:
            check_header(out.save)
        except CheckpointError as e:
            raise UsageError(f"--resume: {e}") from None


def sharded_save(save: str, dist_run: bool) -> bool:
    """Whether the checkpoint at `save` is (to be) a sharded folder: always under torchrun, and in one process
    where `save` already is one (a run on several GPUs continued, or evaluated, on one)."""
    return dist_run or sharded_checkpoint_path(save) is not None


def precision_note(config: TrainConfig) -> str:
    """One line where --precision fp8 runs native precision (ExpertsConfig.at_call's rule on a training batch)."""
    cfg = config.model
    experts, call = cfg.experts, (config.schedule.tokens, cfg.top_k, cfg.num_experts)
    if not experts.fp8 or experts.at_call(*call).fp8:
        return ""
    rows = experts.rows_per_call(*call[:2]) / cfg.num_experts
    return (f"--precision fp8 runs native precision here: the experts average {rows:.0f} rows per call, fewer than "
            f"--fp8-min-rows {experts.fp8_min_rows} (where e4m3 would cost more than it saves; --fp8-min-rows 0 "
            "runs e4m3 at any size)")


def experts_path(cfg, ep: int = 1) -> str:
    """Which code computes the experts on the CPU, as the recipe resolves there (expert parallelism, ep > 1, runs
    the kernels under backend auto)."""
    from ..env import INTERPRET
    if cfg.experts.backend == "reference" or (cfg.experts.backend == "auto" and ep == 1):
        return "the PyTorch reference (the Triton kernels run with --device cuda)"
    return "the Triton kernels under the interpreter" if INTERPRET else "the Triton kernels"
