"""`moeblaze bench`: one MoE layer's forward and training step, side by side with every implementation
importable here, in one run; `--scale` (tokens until out of memory), `--dispatch` (routing index
builders); rows appended as JSON lines to <--out>/<gpu>.jsonl, sharing one run_id."""
from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import json
import os
import shlex
import subprocess
import sys
import time
import uuid

import torch

from ..bench.harness import (IMPLS, available_impls, make_problem, prepare, reference_grads, time_dispatch,
                             time_interleaved)
from ..experts import launch_counts
from . import UsageError, check_device, default_device
from .bench_flags import BenchConfig, Dispatch
from .checkpoint import CheckpointError, probe_writable


def slug(name: str) -> str:
    """A results file's name from its GPU's: lower case, runs of other characters as "-"."""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def run_env(device: torch.device, command: str | None = None) -> dict:
    """What every results row carries: the GPU, torch and triton versions, the commit (MOEBLAZE_GIT_SHA, else git's
    HEAD), a run id, the command (default: this `moeblaze bench` invocation) and the date."""
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sha = os.environ.get("MOEBLAZE_GIT_SHA")
    if not sha:
        try:
            sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=os.path.dirname(__file__)).stdout.strip() or "unknown"
        except OSError:
            sha = "unknown"
    command = command or "moeblaze bench " + shlex.join(sys.argv[2:])
    # an absolute path (the output folder of the machine that ran it) is recorded by its last part
    command = shlex.join(os.path.basename(a.rstrip("/")) if a.startswith("/") else a for a in shlex.split(command))
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "git_sha": sha,
            "run_id": uuid.uuid4().hex[:12], "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


class Recorder:
    def __init__(self, out_dir: str, env: dict):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, f"{slug(env['gpu'])}.jsonl")
        self.env, self.rows = env, []

    def add(self, row: dict) -> dict:
        row = {**row, **self.env}
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        return row


def _fmt(v, nd=2):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def _print_row(r: dict) -> None:
    err = max(r["rel_err"].values()) if r.get("rel_err") else None
    print(f"  {r['impl']:>10} {r['policy']:>9} | fwd {_fmt(r.get('fwd_ms')):>8} ms"
          f" | step {_fmt(r.get('step_ms')):>8} ms | host {_fmt(r.get('host_ms')):>6} ms"
          f" | kept {_fmt(r.get('kept_mb'), 1):>8} MB | peak {_fmt(r.get('peak_mb'), 1):>8} MB"
          f" | {_fmt(r.get('tflops'), 1):>6} TF/s | max rel err {_fmt(err, 4):>7}"
          + (f" | gpu busy {r['gpu_busy_ms']:.2f} ms" if r.get("gpu_busy_ms") is not None else "")
          + f" | {r['status']}", flush=True)


def _oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _base(impl, policy, p, mode) -> dict:
    return dict(mode=mode, impl=impl, policy=policy, L=p.L, d=p.d, h=p.h, E=p.E, K=p.K, activation=p.activation,
                dtype=str(p.dtype).replace("torch.", ""), fwd_ms=None, step_ms=None, host_ms=None, kept_mb=None,
                peak_mb=None, tflops=None, rel_err=None)


def _status(e: BaseException) -> str:
    return "oom" if _oom(e) else f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _run_config(rec, pairs, p, ref, config: BenchConfig, mode="layer"):
    """Every (impl, policy) on one problem: each compiled, checked and its memory measured, then all
    timed in interleaved rounds (harness.time_interleaved), so their ratios share the GPU's state.
    A failure is reported in its row and never stops the others."""
    prepared, failed = {}, {}
    for pair in pairs:
        t0 = time.perf_counter()
        if config.stall_s > 0:
            faulthandler.dump_traceback_later(config.stall_s, exit=False)
        try:
            call = IMPLS[pair[0]][2](p, pair[1])
            launch_counts.clear()
            res = prepare(call, p, ref, config.warmup, busy=config.gpu_busy)
            if pair[0].startswith("moeblaze"):  # which backend each stage of ours ran on (experts.dispatch)
                res["launches"] = sorted(f"{stage}:{backend}" for stage, backend in launch_counts)
            prepared[pair] = (call, res)
            print(f"  {pair[0]:>10} {pair[1]:>9} | compiled, checked, memory measured "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        except Exception as e:  # one implementation's failure is reported in its row and never stops the run
            failed[pair] = _status(e)
        finally:
            faulthandler.cancel_dump_traceback_later()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    times = {}
    if prepared:
        t0 = time.perf_counter()
        times = time_interleaved({pair: call for pair, (call, _) in prepared.items()}, p, config.iters)
        print(f"  timed in interleaved rounds ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = []
    for pair in pairs:
        row = _base(*pair, p, mode)
        if pair in failed:
            row["status"] = failed[pair]
        elif isinstance(times[pair], Exception):
            row.update(prepared[pair][1], status=_status(times[pair]))
        else:
            row.update(prepared[pair][1], **times[pair], status="ok")
        rows.append(rec.add(row))
        _print_row(rows[-1])
    return rows


def _run_hf(rec, config: BenchConfig, device) -> None:
    """--hf: every model on every backend (bench.hf), rows recorded with mode "hf", then the Markdown table."""
    from ..bench import hf

    if device.type != "cuda":
        raise UsageError("--hf trains models at their real widths: it needs a CUDA GPU")
    rows = []

    def report(row: dict) -> None:  # each row recorded as soon as it is measured
        rows.append(rec.add(dict(mode="hf", **row)))
        print(hf.format_row(row), flush=True)
        for kernel, ms, count in row.get("profile", {}).get("top", []):
            print(f"      {ms:8.2f} ms {count:5d}x  {kernel}", flush=True)

    run = config.hf
    for name in run.models:
        print(f"model {name}: {run.layers or hf.LAYERS[name]} layers, batch {run.batch} x {run.seq}", flush=True)
        hf.run_model(name, list(run.backends), run.layers, run.batch, run.seq, config.warmup, run.steps,
                     find_max=run.max_batch > 0, max_limit=run.max_batch, device=device, report=report,
                     profile=run.profile)
    print(hf.markdown(rows))


def _impl_policies(config: BenchConfig, scale=False):
    names = available_impls(list(config.impls) if config.impls else None)
    if config.precision == "fp8" and "moeblaze-fp8" not in names:
        if not available_impls(["moeblaze-fp8"]):
            raise UsageError("--precision fp8 needs fp8 tensor cores (sm_89 or later) or Triton's interpreter")
        names.append("moeblaze-fp8")
    out = []
    for n in names:
        pols = IMPLS[n][1]
        if n.startswith("moeblaze"):
            chunked = ("recompute-chunked",) if scale else ()
            pols = config.policies or pols + chunked
        out += [(n, pol) for pol in pols]
    return out


def check_run(config: BenchConfig) -> BenchConfig:
    """The run after the machine's checks (UsageError naming the flag, before any work): the device, the results
    folder; with the device, warmup and iters the flags left to it decided."""
    device = default_device(config.device)
    check_device(device)
    cpu = device == "cpu"
    config = dataclasses.replace(config, device=device,
                                 warmup=(0 if cpu else 3) if config.warmup is None else config.warmup,
                                 iters=(1 if cpu else 10) if config.iters is None else config.iters)
    try:  # the results folder, probed now: a path that fails only when the first row is written loses the run
        probe_writable(os.path.join(config.out, "results.probe"), "results file")
    except CheckpointError as e:
        raise UsageError(f"--out: {e}") from None
    if device_note := _cpu_note(device):
        print(device_note, flush=True)
    return config


def _cpu_note(device: str) -> str:
    """What runs on the CPU: said once, so that a CPU run's times are not mistaken for the kernels' speed."""
    if device != "cpu":
        return ""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return ("moeblaze bench: on the CPU without Triton's interpreter moeblaze's kernels can't run, so only the "
                "reference and torch rows do")
    return ("moeblaze bench: on the CPU moeblaze's kernels run under Triton's interpreter: what each keeps for "
            "backward is theirs, the times are the interpreter's (the kernels' speed needs a CUDA GPU)")


def run(config: BenchConfig):
    """Time what `config` says (bench_flags.check_flags builds it from flags)."""
    config = check_run(config)
    device = torch.device(config.device)
    dtype = getattr(torch, config.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    rec = Recorder(config.out, run_env(device))
    print(f"moeblaze bench: run {rec.env['run_id']} on {rec.env['gpu']}, torch {rec.env['torch']}, "
          f"triton {rec.env['triton']}; rows -> {rec.path}", flush=True)
    if config.hf:
        _run_hf(rec, config, device)
        return
    pairs = _impl_policies(config)
    if config.dispatch:
        _run_dispatch(rec, config.dispatch, device)
    for name, (L, d, h, E, K) in config.layer_configs():
        print(f"config {name}: L={L} d={d} h={h} E={E} K={K} {config.activation} {dtype}", flush=True)
        t0 = time.perf_counter()
        p = make_problem(L, d, h, E, K, config.activation, dtype=dtype, device=device)
        ref = reference_grads(p) if config.reference else None
        print(f"  inputs and fp32 reference ready ({time.perf_counter() - t0:.0f} s)", flush=True)
        _run_config(rec, pairs, p, ref, config)
        del p, ref
    if config.scale:
        _run_scale(rec, config, device, dtype)


def _run_dispatch(rec, sweep: Dispatch, device) -> None:
    """--dispatch: the routing index builders at every (L, E, K) of the flags, a row each."""
    for L in sweep.L:
        for E in sweep.E:
            for K in (k for k in sweep.K if k <= E):
                try:
                    ms = time_dispatch(L, E, K, device)
                    status = "ok"
                except Exception as e:
                    ms, status = {}, ("oom" if _oom(e) else f"error: {type(e).__name__}: {e}")
                row = rec.add(dict(mode="dispatch", L=L, E=E, K=K, dispatch_ms=ms, status=status))
                sp = ms.get("sort", 0) / ms["dense"] if ms.get("dense") else None
                print(f"  dispatch L={L:>8} E={E:>4} K={K}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
                      + (f" | sort/dense {sp:.2f}x" if sp else "") + f" | {row['status']}", flush=True)


def _run_scale(rec, config: BenchConfig, device, dtype) -> None:
    """--scale: tokens doubling from --min-tokens, each implementation alone until it runs out of memory."""
    _, d, h, E, K = config.scale.shape
    pairs = _impl_policies(config, scale=True)
    alive = dict.fromkeys(pairs, True)
    L = config.scale.min_tokens
    while L <= config.scale.max_tokens and any(alive.values()):
        print(f"scale: L={L} d={d} h={h} E={E} K={K}", flush=True)
        try:
            p = make_problem(L, d, h, E, K, config.activation, dtype=dtype, device=device, n_sets=1)
        except Exception as e:
            if not _oom(e):
                raise
            print("  inputs do not fit: stop", flush=True)
            break
        for pair in pairs:
            if alive[pair]:
                row = _run_config(rec, [pair], p, None, config, "scale")[0]  # each alone, to its own limit
                alive[pair] = row["status"] == "ok"
        del p
        L *= 2
