"""`moeblaze train` under torchrun on CPU processes (gloo; the kernels under the interpreter, the reference experts
where no expert parallelism runs and the subject is the run, not the experts): a few steps on 2 ranks with expert
parallelism and FSDP2 (both dispatch modes; capacity dispatch with a capacity too small, so that the step is rerun
with a larger one) end at the training loss of one process over the same global batch (FSDP2 alone:
tests/distributed/test_fsdp.py);
a sharded checkpoint written at ep = 2 resumes at ep = 1 and in one process with the same weights (and one process
goes on training and saving it), and a damaged one is refused; a rank SIGKILLed during sharded saves leaves a
checkpoint that resumes; --on-overflow drop counts what it drops."""
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moeblaze.cli import main
from moeblaze.cli.checkpoint import MANIFEST, CheckpointError, verify_sharded

TINY = ["--seq-len", "16", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--num-experts", "4",
        "--d-expert", "32", "--backend", "triton", "--aux-loss-coef", "0"]
REFERENCE = ["--backend", "reference"]  # (a later flag overrides TINY's)
TOL = 1e-5
CLI = str(Path(__file__).parents[1] / "moeblaze_cli.py")  # the command line, kernels interpreted as in this process


def _run(tmp_path, world, *flags, torchrun=None):
    """The command's output: under torchrun at `world` processes, or (world 1 without torchrun) in this process."""
    if not (world > 1 if torchrun is None else torchrun):
        out, cwd = io.StringIO(), os.getcwd()
        os.chdir(tmp_path)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = main(["train", *TINY, *flags])
        finally:
            os.chdir(cwd)
        assert code == 0, out.getvalue()[-3000:]
        return out.getvalue()
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--standalone",
                        CLI, "train", *TINY, *flags], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def _bench_losses(tmp_path) -> list[dict]:
    with open(tmp_path / "res" / "cpu.jsonl") as f:
        return [json.loads(line) for line in f]


def test_two_ranks_train_like_one_process(tmp_path):
    bench = ["--bench-steps", "3", "--bench-warmup", "1", "--results", str(tmp_path / "res")]
    _run(tmp_path, 1, *bench, "--batch-size", "4")
    _run(tmp_path, 2, *bench, "--batch-size", "2", "--ep", "2")
    out = _run(tmp_path, 2, *bench, "--batch-size", "2", "--ep", "2", "--ep-dispatch", "capacity",
               "--capacity-factor", "0.25")
    one, *rows = _bench_losses(tmp_path)
    assert (one["world"], one["ep"]) == (1, 1)
    assert [(r["world"], r["ep"], r["dispatch"]) for r in rows] == [(2, 2, "exact"), (2, 2, "capacity")]
    for r in rows:
        assert abs(r["loss"] - one["loss"]) <= TOL * one["loss"], (r, one)
    assert out.count("capacity overflow") == 1, out  # said once (rank 0), then the rerun needed no more
    assert rows[1]["capacity"] > 16


def test_one_process_under_torchrun_is_fsdp2_on_one_rank(tmp_path):
    """torchrun at one process runs what it runs at N (FSDP2, a sharded checkpoint), on a one-rank group, with the
    plain process's validation loss: one GPU's measure of FSDP2's own cost."""
    common = [*REFERENCE, "--batch-size", "2", "--steps", "2", "--eval-every", "2", "--eval-batches", "2"]
    plain = _run(tmp_path, 1, *common, "--save", "")
    one_rank = _run(tmp_path, 1, *common, "--save", "ck", torchrun=True)
    assert "1 processes (efsdp 1 x ep 1)" in one_rank and "processes" not in plain, one_rank[-2000:]
    assert sorted(os.listdir(tmp_path / "ck")) == [".metadata", "__0_0.distcp", MANIFEST]
    val = [float(re.search(r"final validation loss ([0-9.]+)", s).group(1)) for s in (plain, one_rank)]
    assert abs(val[1] - val[0]) <= TOL * val[0], val


def test_sharded_checkpoint_resumes_at_another_mesh_and_refuses_damage(tmp_path):
    ck = str(tmp_path / "ck")
    common = ["--batch-size", "2", "--steps", "4", "--eval-every", "4", "--eval-batches", "2", "--save", ck]
    first = _run(tmp_path, 2, *common, "--ep", "2")
    assert sorted(os.listdir(ck)) == [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST]
    again = _run(tmp_path, 2, *common, "--resume")  # efsdp 2 x ep 1: the experts resharded
    alone = _run(tmp_path, 1, *common, "--resume", "--batch-size", "4")  # one process: every expert, whole
    for out in (again, alone):
        assert "resumed from" in out and "nothing to train" in out
    val = [re.search(r"final validation loss ([0-9.]+)", s).group(1) for s in (first, again, alone)]
    assert val[0] == val[1] == val[2], val
    more = _run(tmp_path, 1, *common, "--resume", "--batch-size", "4", "--steps", "6")  # and one process goes on
    assert "resumed from" in more and "step 6" in more
    verify_sharded(ck)  # written again, sharded, by one process
    path = os.path.join(ck, "__0_0.distcp")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        verify_sharded(ck)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                        CLI, "train", *TINY, *common, "--resume", "--steps", "8"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode != 0 and "corrupted" in p.stderr, p.stderr[-2000:]


def _capacity_run(folder: Path, factor: str, *flags) -> tuple[str, list[dict], dict]:
    """Three steps at ep 2 under capacity dispatch at `factor`, DeepSeek-V3's expert-bias balancing: (the output,
    each step's loss-log row, the saved expert biases)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    log, ck = folder / f"loss-{factor}.jsonl", folder / f"ck-{factor}"
    out = _run(folder, 2, "--batch-size", "2", "--ep", "2", "--ep-dispatch", "capacity", "--capacity-factor", factor,
               "--router", "deepseek-v3", "--num-experts", "8", "--steps", "3", "--eval-every", "100",
               "--eval-batches", "1", "--save", str(ck), "--loss-log", str(log), *flags)
    rows = [json.loads(line) for line in open(log) if "grad_norm" in line]
    dcp_to_torch_save(str(ck), str(folder / f"{factor}.pt"))
    state = torch.load(folder / f"{factor}.pt", weights_only=False)["model"]
    return out, rows, {k: v for k, v in state.items() if k.endswith("expert_bias")}


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    """A capacity large enough from the start: nothing overflows, so what --on-overflow says to do never happens
    (drop here) and the run is every policy's."""
    return _capacity_run(tmp_path_factory.mktemp("roomy"), "8", "--on-overflow", "drop")


def test_a_rerun_step_leaves_the_state_of_one_that_never_overflowed(tmp_path, roomy):
    """Capacity dispatch with a capacity too small at the first step (rerun once, grown) against one large enough
    from the start, with DeepSeek-V3's expert-bias balancing: every step's loss and per-layer load, and so the
    expert biases that steer the next steps' routing, are those of the run that never overflowed (the discarded
    pass once added its loads to the counters)."""
    import torch

    out, rerun, biases = _capacity_run(tmp_path, "0.25")
    assert out.count("capacity overflow") == 1, out
    assert roomy[0].count("capacity overflow") == 0, roomy[0]
    never, roomy_biases = roomy[1], roomy[2]
    assert len(rerun) == len(never) == 3
    for a, b in zip(rerun, never):
        assert abs(a["loss"] - b["loss"]) <= TOL * b["loss"], (a, b)
        assert a["load_max_mean"] == b["load_max_mean"], (a, b)
    assert roomy_biases and biases.keys() == roomy_biases.keys()
    for k, v in roomy_biases.items():
        assert torch.equal(biases[k], v), (k, biases[k], v)
        assert v.abs().sum() > 0, k  # the biases did move


def test_dropped_rows_are_counted_and_said(tmp_path, roomy):
    """--on-overflow drop with a capacity too small: the loss log has each step's dropped rows (all ranks'), and
    the run ends saying how many it dropped; with a capacity large enough, none."""
    for (out, rows, _), some in ((_capacity_run(tmp_path, "0.25", "--on-overflow", "drop"), True), (roomy, False)):
        assert len(rows) == 3 and all(isinstance(r["dropped_rows"], int) for r in rows), rows
        total = sum(r["dropped_rows"] for r in rows)
        assert (total > 0) == some, rows
        said = re.search(r"capacity dispatch dropped ([\d,]+) rows over the run", out)
        assert said and int(said.group(1).replace(",", "")) == total, out[-2000:]


def _children(pid: int) -> list[int]:
    """The pids whose parent is pid (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks' processes through /proc")
def test_sigkill_of_one_rank_during_sharded_saves_leaves_a_checkpoint_that_resumes(tmp_path):
    """Two ranks save a sharded checkpoint every step; one rank is SIGKILLed at varying moments after a save of
    this run (torchrun then stops the other). Each time the folder verifies and resumes in one process at the step
    it holds, never earlier than the last round's, and the next round's two ranks resume from it."""
    import signal
    import time

    ck = str(tmp_path / "ck")
    manifest = os.path.join(ck, MANIFEST)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    common = [*REFERENCE, "--batch-size", "2", "--eval-every", "100000", "--eval-batches", "1", "--save", ck,
              "--save-every", "1"]
    held = [0]
    for delay in (0.0, 0.6):
        started = time.time_ns()
        launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                     "--standalone", CLI, "train", *TINY, *common, "--steps",
                                     "100000", *(["--resume"] if held[-1] else [])],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp_path)
        deadline = time.time() + 240
        while not (os.path.exists(manifest) and os.stat(manifest).st_mtime_ns > started):
            assert launcher.poll() is None and time.time() < deadline, "no save came"
            time.sleep(0.02)
        time.sleep(delay)
        workers = [p for agent in _children(launcher.pid) for p in _children(agent) + [agent]
                   if CLI in open(f"/proc/{p}/cmdline").read() and "train" in
                   open(f"/proc/{p}/cmdline").read() and "torch.distributed.run" not in
                   open(f"/proc/{p}/cmdline").read()]
        assert workers, "no rank process found"
        os.kill(workers[-1], signal.SIGKILL)
        assert launcher.wait(timeout=120) != 0
        verify_sharded(ck)
        out = _run(tmp_path, 1, *common, "--resume", "--batch-size", "4", "--steps", "1")
        step = int(re.search(r"resumed from .* at step (\d+)", out).group(1))
        assert step >= max(held[-1], 1), (held, step, out[-1500:])
        held.append(step)


def test_a_capacity_overflow_under_on_overflow_error_is_one_line_per_rank(tmp_path):
    """--on-overflow error with a capacity too small: the ranks say what overflowed in one `moeblaze train: error:`
    line and exit 1, with no traceback through moeblaze's code (torchrun's own report of the failed workers follows;
    it stops the other rank once one has exited, which may be before that rank has printed its line)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", CLI,
                        "train", *TINY, "--batch-size", "2", "--ep", "2", "--ep-dispatch", "capacity",
                        "--capacity-factor", "0.25", "--on-overflow", "error", "--steps", "2", "--save", ""],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert 1 <= out.count("moeblaze train: error: capacity dispatch: a destination needs more than") <= 2, out[-3000:]
    assert not [line for line in out.splitlines() if line.strip().startswith("File ") and "moeblaze" in line
                and "moeblaze_cli.py" not in line], out[-3000:]
