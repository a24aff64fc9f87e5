"""The checks of `moeblaze train` that ask the machine, after cli/train_flags.py's checks of the flags alone: the
device, the backend where the run's tensors will be, the processes torchrun started, the files the run will write;
then the model config. A bad one exits with status 2 and one line naming the flag, before any work starts.

Memory: none beyond the parsed arguments.
"""
from __future__ import annotations

import os

import torch

from ..env import INTERPRET
from ..distributed.ep import check_options
from ..experts.dispatch import choose
from ..nn import ModelConfig
from . import UsageError, check_device, parallel
from .checkpoint import (CheckpointError, check_header, probe_writable, probe_writable_folder,
                         sharded_checkpoint_path)
from .graph_step import check_graphable
from .train_flags import check_flags


def check_args(args, val_len: int) -> ModelConfig:
    """The model config of the flags, after every flag is checked (UsageError naming the flag otherwise): the
    flags' own checks (train_flags.check_flags), then the machine's; fills --device, --save and the preset's
    options left unset."""
    cfg = check_flags(args)
    dist_run = parallel.launched()
    if args.save is None:
        args.save = "checkpoints/moeblaze-sharded" if dist_run else "checkpoints/moeblaze.pt"
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    explicit = [f for f, on in (("--fsdp-keep-gathered", args.fsdp_keep_gathered == "yes"),
                                ("--fsdp-reduce-dtype bfloat16", args.fsdp_reduce_dtype == "bfloat16")) if on]
    if explicit and not dist_run:
        raise UsageError(f"{explicit[0]} sets FSDP2, which runs under torchrun (--nproc-per-node 1 or more)")
    args.layout_note = parallel.choose_layout(args, cfg, dist_run)
    try:
        if args.seq_len > val_len - 2:
            raise ValueError(f"--seq-len must be at most {val_len - 2} (the held-out text's length - 2), "
                             f"got {args.seq_len}")
        if args.ep > 1:  # the recipe expert parallelism runs
            check_options(cfg.experts)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    experts = cfg.experts
    check_device(args.device)
    if args.cuda_graph:
        check_graphable(args)
    if args.compile and args.device != "cuda":
        raise UsageError("--compile needs --device cuda (the interpreter's kernels do not compile)")
    if args.dtype == "bfloat16" and args.device != "cuda":
        raise UsageError("--dtype bfloat16 needs --device cuda")
    if experts.backend not in ("auto", "reference") and args.device != "cuda" and not INTERPRET:
        raise UsageError(f"--backend {experts.backend} runs the kernels: it needs --device cuda (or TRITON_INTERPRET=1 "
                         "set before the command starts)")
    try:  # the backend where the run's tensors will be: what the layer itself would refuse at its first call
        choose(experts.backend, torch.device(args.device))
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--backend {experts.backend}: {e}") from None
    _check_processes(args, experts, dist_run)
    _probe_outputs(args, dist_run)
    return cfg


def _check_processes(args, experts, dist_run: bool) -> None:
    """UsageError unless the processes torchrun started (or not) run what the flags ask: FSDP2's flags under
    torchrun, --ep dividing the processes and the experts, expert parallelism on the kernels."""
    fsdp_flags = [f for f, on in (("--fsdp-units model", args.fsdp_units != "blocks"),) if on]
    if fsdp_flags and not dist_run:
        raise UsageError(f"{fsdp_flags[0]} sets FSDP2, which runs under torchrun (--nproc-per-node 1 or more)")
    if args.fsdp_reduce_dtype != "float32" and args.dtype != "bfloat16":
        raise UsageError("--fsdp-reduce-dtype bfloat16 needs --dtype bfloat16 (float32 parameters reduce in float32)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist_run and world % args.ep == 0:  # (an --ep that doesn't divide the processes: refused below)
        from ..distributed.fsdp import check_weight_cache

        try:
            check_weight_cache(experts, world // args.ep, args.ep)
        except ValueError as e:
            raise UsageError(f"--fp8-weight-cache: {e}") from None
    if args.ep > 1:
        if not dist_run:
            raise UsageError(f"--ep {args.ep} needs {args.ep} or more processes: run under torchrun "
                             "--nproc-per-node N")
        if world % args.ep:
            raise UsageError(f"--ep {args.ep} must divide the number of processes ({world})")
        if args.num_experts % args.ep:
            raise UsageError(f"--ep {args.ep} must divide --num-experts ({args.num_experts})")
        if experts.backend == "reference":
            raise UsageError("--ep runs the experts on the Triton kernels, not --backend reference")
        if args.device != "cuda" and not INTERPRET:
            raise UsageError("--ep runs the experts on the Triton kernels: --device cuda, or on the CPU "
                             "TRITON_INTERPRET=1 set before the command starts")


def _probe_outputs(args, dist_run: bool) -> None:
    """UsageError unless every file the run will write can be written: the checkpoint, the loss log, the trace,
    the results file (a path that fails only when first written loses the run's work). A refusal takes away the
    folders the probes before it made."""
    missing = [d for d in _missing_folders(args) if not os.path.exists(d)]
    try:
        _probe_each(args, dist_run)
    except UsageError:
        for d in sorted(missing, key=len, reverse=True):  # deepest first; only those still empty
            if os.path.isdir(d) and not os.listdir(d):
                os.rmdir(d)
        raise


def _missing_folders(args) -> list[str]:
    """Every folder on the way to an output path (the probes make those missing)."""
    out = []
    for path in (args.save, args.loss_log, args.bench_trace, args.results and os.path.join(args.results, "x")):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        while folder and os.path.dirname(folder) != folder:
            out.append(folder)
            folder = os.path.dirname(folder)
    return out


def _probe_each(args, dist_run: bool) -> None:
    if args.overwrite and not args.save:
        raise UsageError("--overwrite replaces the checkpoint at --save, and --save '' saves none: leave one out")
    if args.save and not args.bench_steps:
        _check_existing(args, dist_run)
        try:
            (probe_writable_folder if sharded_save(args.save, dist_run) else probe_writable)(args.save)
        except CheckpointError as e:
            raise UsageError(f"--save: {e}") from None
    outputs = [("--loss-log", args.loss_log, "loss log"), ("--bench-trace", args.bench_trace, "trace")]
    if args.bench_steps:  # a folder: the results file goes in it
        outputs.append(("--results", args.results and os.path.join(args.results, "results.probe"), "results file"))
    for flag, path, what in outputs:
        if path:
            try:
                probe_writable(path, what)
            except CheckpointError as e:
                raise UsageError(f"{flag}: {e}") from None


def _check_existing(args, dist_run: bool) -> None:
    """A new run never replaces a checkpoint unasked (UsageError unless --resume or --overwrite says what to do with
    the one at --save); --resume's file must start as a checkpoint does, found before any work."""
    sharded = sharded_checkpoint_path(args.save)
    there = sharded is not None or os.path.isfile(args.save)
    if os.path.isfile(args.save) and sharded is None and not args.resume:  # a checkpoint only if it starts as one
        # (under --resume the header check below says so, as --resume's)
        try:
            check_header(args.save)
        except CheckpointError:
            raise UsageError(f"--save: {args.save} is a file but not a moeblaze checkpoint: moeblaze replaces only "
                             "its own checkpoints; give another path") from None
    if args.overwrite and not there:
        raise UsageError(f"--overwrite: there is no checkpoint at {args.save} to replace; leave --overwrite out")
    if there and not (args.resume or args.overwrite):
        raise UsageError(f"--save: {args.save} holds a checkpoint already: --resume continues it, --overwrite "
                         "replaces it, --save PATH writes another")
    if args.resume and os.path.isfile(args.save) and not dist_run and sharded is None:
        try:
            check_header(args.save)
        except CheckpointError as e:
            raise UsageError(f"--resume: {e}") from None


def sharded_save(save: str, dist_run: bool) -> bool:
    """Whether the checkpoint at `save` is (to be) a sharded folder: always under torchrun, and in one process
    where `save` already is one (a run on several GPUs continued, or evaluated, on one)."""
    return dist_run or sharded_checkpoint_path(save) is not None


def precision_note(args, cfg) -> str:
    """One line where --precision fp8 runs native precision (ExpertsConfig.at_call's rule on a training batch)."""
    experts, call = cfg.experts, (args.batch_size * args.seq_len, cfg.top_k, cfg.num_experts)
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
