import argparse
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict

import pytest
import torch

from moeblaze import RouterConfig
from moeblaze.cli import main, parallel, train, train_flags
from moeblaze.cli.train_config import Machine, Parallel, TrainConfig
from moeblaze.nn import ModelConfig
from moeblaze.cli.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from moeblaze.cli.data import builtin_corpus, split_corpus, unigram_entropy


def args_for(tmp_path, **over):
    p = argparse.ArgumentParser()
    train_flags.add_arguments(p)
    a = p.parse_args([])
    base = dict(steps=30, batch_size=8, seq_len=32, d_model=32, n_layers=1, n_heads=2, num_experts=4, top_k=2,
                d_expert=32, eval_every=30, eval_batches=2, save=str(tmp_path / "ck.pt"), save_every=15,
                device="cpu")
    for k, v in {**base, **over}.items():
        setattr(a, k, v)
    return train_flags.check_flags(a)


def test_corpus_is_builtin_and_entropy_is_sane():
    train_t, val_t = split_corpus(builtin_corpus())
    assert len(train_t) > 100_000 and len(val_t) > 10_000
    assert 2.5 < unigram_entropy(train_t) < 5.6  # bytes of English text: ~4.5-5 bits


def test_short_training_run_learns_and_checkpoints(tmp_path):
    res = train.run(args_for(tmp_path, steps=200, eval_every=100, batch_size=16))
    assert res["val_loss"] < res["unigram_entropy"]
    ck = load_checkpoint(str(tmp_path / "ck.pt"))
    assert ck["step"] == 200 and not [f for f in os.listdir(tmp_path) if ".tmp." in f]


def test_resume_continues_from_the_saved_step(tmp_path, capsys):
    train.run(args_for(tmp_path, steps=15))
    res = train.run(args_for(tmp_path, steps=30, resume=True))
    assert "resumed from" in capsys.readouterr().out and res["step"] == 30


def test_resume_rejects_a_different_model_naming_what_differs(tmp_path):
    train.run(args_for(tmp_path, steps=15))
    with pytest.raises(SystemExit, match=r"another model: d_model \(checkpoint 32, flags 64\)$"):
        train.run(args_for(tmp_path, steps=30, resume=True, d_model=64))


def test_resume_goes_on_under_other_execution_choices(tmp_path, capsys):
    """The checkpoint policy, the kernels and token rounding say how a run computes, not what its model is: a run
    resumes under other values of them."""
    train.run(args_for(tmp_path, steps=10))
    res = train.run(args_for(tmp_path, steps=14, resume=True, checkpoint_policy="recompute", token_rounding="up",
                             rounding_tile=8))
    assert res["step"] == 14 and "resumed from" in capsys.readouterr().out


@pytest.mark.parametrize("change,message", [
    (lambda ck: ck["config"].update(no_such_field=1), "config is not one this version reads"),
    (lambda ck: ck.pop("optimizer"), "lacks optimizer"),
    (lambda ck: ck.update(step=-3), "step is -3"),
    (lambda ck: ck["model"].update({"tok_emb.weight": torch.zeros(3, 3)}), "tok_emb.weight has shape (3, 3)"),
    (lambda ck: ck["model"].update({"no_such.weight": torch.zeros(3, 3)}), "model does not fit"),
])
def test_resume_refuses_foreign_content_in_one_line(tmp_path, capsys, change, message):
    """A checksummed file whose content this version did not write: refused by name, exit 2, nothing trained."""
    path = str(tmp_path / "ck.pt")
    assert main(["train", *TINY, "--save", path]) == 0
    ck = load_checkpoint(path)
    change(ck)
    save_checkpoint(path, ck)
    assert main(["train", *TINY, "--steps", "8", "--save", path, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("moeblaze train: error: --resume:"), err


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ck.pt")
    save_checkpoint(path, {"step": 1})

    def crash(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", crash)  # after the temporary is written, before it replaces the checkpoint
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1 and os.listdir(tmp_path) == ["ck.pt"]


def test_cli_entry_point(tmp_path):
    assert main(["train", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--d-model", "16", "--n-layers",
                 "1", "--n-heads", "2", "--num-experts", "4", "--d-expert", "16", "--eval-every", "2",
                 "--eval-batches", "1", "--save", ""]) == 0


TINY = ["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--d-model", "16", "--n-layers", "1", "--n-heads", "2",
        "--num-experts", "4", "--d-expert", "16", "--eval-batches", "1", "--eval-every", "4"]


@pytest.mark.parametrize("flags,message", [
    (["--eval-every", "0"], "--eval-every must be >= 1, got 0"),
    (["--save-every", "0"], "--save-every must be >= 1, got 0"),
    (["--eval-batches", "0"], "--eval-batches must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    (["--steps", "-5"], "--steps must be >= 1, got -5"),
    (["--seq-len", "10000000"], "--seq-len must be at most"),
    (["--lr", "nan"], "--lr must be a positive finite number"),
    (["--aux-loss-coef", "-1"], "--aux-loss-coef must be a finite number >= 0"),
    (["--top-k", "5"], "top_k must satisfy 1 <= top_k <= num_experts (4), got 5"),
    (["--n-heads", "3"], "d_model (16) must be divisible by n_heads (3)"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--resume", "--save", ""], "--resume needs a checkpoint path"),
    (["--bench-steps", "2", "--bench-trace", "t.json"], "--bench-trace keeps --bench-profile's trace"),
    (["--fsdp-keep-gathered"], "--fsdp-keep-gathered sets FSDP2, which runs under torchrun"),
    (["--fsdp-units", "model"], "--fsdp-units model sets FSDP2, which runs under torchrun"),
    (["--fsdp-reduce-dtype", "bfloat16"], "--fsdp-reduce-dtype bfloat16 sets FSDP2, which runs under torchrun"),
])
def test_bad_arguments_fail_before_any_work(tmp_path, monkeypatch, capsys, flags, message):
    def no_work(*a, **k):
        raise AssertionError("the model was built before the arguments were checked")

    monkeypatch.setattr(train, "MoEModel", no_work)
    assert main(["train", *TINY, "--save", str(tmp_path / "ck.pt"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeblaze train: error: ") and message in err and "\n" not in err
    assert os.listdir(tmp_path) == []


def test_bench_profile_keeps_its_trace_where_asked(tmp_path, capsys):
    import json

    trace = tmp_path / "traces" / "step.json"
    assert main(["train", *TINY, "--save", "", "--bench-steps", "2", "--bench-warmup", "1", "--bench-profile",
                 "--bench-trace", str(trace), "--results", str(tmp_path / "res")]) == 0
    (row,) = [json.loads(line) for line in open(tmp_path / "res" / "cpu.jsonl")]
    assert row["split"]["host_top_ms"]
    ops = [e["name"] for e in json.load(open(trace))["traceEvents"] if e.get("cat") == "cpu_op"]
    assert "aten::mm" in ops or "aten::addmm" in ops, ops[:20]


def test_bad_save_paths_fail_up_front_and_leave_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train, "MoEModel", lambda *a: pytest.fail("the model was built before --save was probed"))
    (tmp_path / "file").write_text("")
    (tmp_path / "dir").mkdir()
    bad = {str(tmp_path / "file" / "ck.pt"): "is a file, not a folder", str(tmp_path / "dir"): "is a directory"}
    if sys.platform == "linux":
        bad["/proc/moeblaze-no-such-folder/ck.pt"] = "can't write the checkpoint"
    if hasattr(os, "geteuid") and os.geteuid() != 0:  # root writes through any mode bits
        (tmp_path / "ro").mkdir(mode=0o500)
        bad[str(tmp_path / "ro" / "ck.pt")] = "Permission denied"
    for path, message in bad.items():
        assert main(["train", *TINY, "--save", path]) == 2, path
        err = capsys.readouterr().err
        assert "moeblaze train: error: --save" in err and message in err, err
    assert sorted(os.listdir(tmp_path)) == sorted(["file", "dir"] + (["ro"] if (tmp_path / "ro").exists() else []))
    assert os.listdir(tmp_path / "dir") == []


def test_every_output_path_fails_up_front(tmp_path, monkeypatch, capsys):
    """A trailing slash, a file where a folder goes, a folder where a file goes: each output flag is refused before
    the model is built (each once failed only at its first write, after the training)."""
    monkeypatch.setattr(train, "MoEModel", lambda *a: pytest.fail("the model was built before the outputs were probed"))
    (tmp_path / "file").write_text("")
    cases = [(["--save", str(tmp_path / "ckdir") + "/"], "--save", "is a directory"),
             (["--save", str(tmp_path / "file") + "/"], "--save", "is a directory"),
             (["--loss-log", str(tmp_path)], "--loss-log", "is a directory"),
             (["--loss-log", str(tmp_path / "file" / "l.jsonl")], "--loss-log", "is a file, not a folder"),
             (["--bench-steps", "1", "--results", str(tmp_path / "file" / "sub")], "--results",
              "is a file, not a folder")]
    for flags, flag, message in cases:
        assert main(["train", *TINY, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert f"moeblaze train: error: {flag}" in err and message in err, err
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_a_sharded_folder_without_its_manifest_is_never_overwritten(tmp_path, monkeypatch, capsys):
    """Under torchrun a checkpoint is a folder with a manifest; a folder that holds files but no manifest (a copy
    that lost a file, a foreign folder) is refused by name, with or without --resume, and left as it was."""
    monkeypatch.setattr(train, "MoEModel", lambda *a: pytest.fail("the model was built before --save was probed"))
    monkeypatch.setattr(parallel, "launched", lambda: True)
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"shard")
    for resume in ([], ["--resume"]):
        assert main(["train", *TINY, "--save", str(folder), *resume]) == 2
        err = capsys.readouterr().err
        assert "--save" in err and "no moeblaze-manifest.sha256" in err, err
    assert os.listdir(folder) == ["__0_0.distcp"] and (folder / "__0_0.distcp").read_bytes() == b"shard"


def _trained_checkpoint(tmp_path) -> str:
    path = str(tmp_path / "ck.pt")
    assert main(["train", *TINY, "--save", path]) == 0
    return path


@pytest.mark.parametrize("damage", ["flip one byte", "64 random bytes", "truncate", "header"])
def test_a_damaged_checkpoint_is_refused(tmp_path, capsys, damage):
    path = _trained_checkpoint(tmp_path)
    data = bytearray(open(path, "rb").read())
    mid = len(data) // 2
    if damage == "flip one byte":
        data[mid] ^= 0x01
    elif damage == "64 random bytes":
        data[mid: mid + 64] = os.urandom(64)
    elif damage == "truncate":
        del data[mid:]
    else:
        data[0] ^= 0x20
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
    assert main(["train", *TINY, "--steps", "8", "--save", path, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.match("moeblaze train: error: --resume: .*(corrupted|not a moeblaze checkpoint)", err[-1]), err


def test_resume_says_when_there_is_no_checkpoint_or_nothing_to_train(tmp_path, capsys):
    path = str(tmp_path / "ck.pt")
    assert main(["train", *TINY, "--save", path, "--resume"]) == 0
    assert f"--resume: no checkpoint at {path}; starting from step 0" in capsys.readouterr().out
    assert main(["train", *TINY, "--steps", "2", "--save", path, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "the checkpoint is at step 4, not before --steps 2: nothing to train" in out
    assert "saved to" not in out, out  # nothing was written: it says so only of a checkpoint it wrote
    assert load_checkpoint(path)["step"] == 4


def test_a_save_removes_temporaries_of_dead_saves_only(tmp_path):
    path = str(tmp_path / "ck.pt")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid in (dead.pid, 1, os.getpid()):  # pid 1 always runs: a live save by another process is left alone
        open(f"{path}.tmp.{pid}", "wb").write(b"partial")
    save_checkpoint(path, {"step": 1})
    assert sorted(os.listdir(tmp_path)) == ["ck.pt", "ck.pt.tmp.1"]


def test_sigkill_during_saves_leaves_a_loadable_checkpoint_and_the_next_save_cleans_up(tmp_path):
    """A child saves a 4 MB state in a loop; it is SIGKILLed at varying moments, several times. After every
    kill the checkpoint verifies and holds one complete state; a save by the next process removes the dead
    temporaries."""
    path = str(tmp_path / "ck.pt")
    child = textwrap.dedent(f"""
        import sys, torch
        from moeblaze.cli.checkpoint import save_checkpoint
        i = 0
        while True:
            i += 1
            save_checkpoint({path!r}, {{"step": i, "w": torch.full((1 << 20,), float(i))}})
            if i == 1:
                print("saved", flush=True)
    """)
    steps = []
    for delay in (0.0, 0.013, 0.05, 0.11, 0.2, 0.37):
        proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "saved"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = load_checkpoint(path)
        assert torch.equal(state["w"], torch.full((1 << 20,), float(state["step"])))
        steps.append(state["step"])
    save_checkpoint(path, {"step": 0})
    assert os.listdir(tmp_path) == ["ck.pt"], steps


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ck.pt")
    real = torch.nn.functional.cross_entropy
    calls = []

    def loss_that_diverges_at_step_5(*a, **k):
        calls.append(1)
        out = real(*a, **k)
        return out * float("nan") if len(calls) >= 5 else out

    monkeypatch.setattr(train.F, "cross_entropy", loss_that_diverges_at_step_5)
    with pytest.raises(SystemExit, match=r"non-finite training loss at step 5: stopped at step 6; the checkpoint "
                                         r".*\(step 4\) is left as it was"):
        main(["train", *TINY, "--steps", "20", "--eval-every", "100", "--save-every", "2", "--save", path])
    monkeypatch.undo()
    ck = load_checkpoint(path)
    assert ck["step"] == 4 and all(torch.isfinite(v).all() for v in ck["model"].values())


def test_progress_shows_the_mean_aux_loss_over_blocks(tmp_path, capsys):
    """aux at 1.0 is balanced for one block; with 4 blocks the sum would sit near 4."""
    assert main(["train", *TINY, "--n-layers", "4", "--steps", "10", "--save", ""]) == 0
    shown = [float(v) for v in re.findall(r"aux=([0-9.]+)", capsys.readouterr().err)]
    assert shown and all(0.9 < v < 2.0 for v in shown), shown


def test_presets_of_today_s_routing_train(tmp_path):
    """deepseek-v3-small (sigmoid scores, groups, the sequence loss, a shared expert, a dense first layer, the
    expert bias moved every step) and qwen3-next-small (a gated shared expert) train, from their presets."""
    shape = dict(d_model=None, n_layers=None, n_heads=None, num_experts=None, top_k=None, d_expert=None)
    res = train.run(args_for(tmp_path, steps=6, eval_every=6, save_every=6, preset="deepseek-v3-small", **shape))
    assert math.isfinite(res["val_loss"])
    ck = load_checkpoint(str(tmp_path / "ck.pt"))
    assert ck["config"]["router"] == asdict(RouterConfig.family("deepseek-v3")) and ck["config"]["dense_layers"] == 1
    state = ck["model"]
    assert "blocks.0.moe.up.weight" in state and "blocks.1.moe.shared.w1" in state
    bias = state["blocks.1.moe.router.expert_bias"]
    # moved, and centred in fp32: E values each rounded once, summing to E · 2^-24 of their size, far below 1e-5
    assert bias.abs().sum() > 0 and abs(float(bias.sum())) < 1e-5
    assert state["blocks.1.moe.router.expert_load"].abs().sum() == 0  # counted since the last update: nothing
    res = train.run(args_for(tmp_path, steps=4, eval_every=4, save="", preset="qwen3-next-small", **shape))
    assert math.isfinite(res["val_loss"])


def test_loss_log_has_each_step_s_loss_gradient_norm_and_load_then_the_validation(tmp_path):
    import json

    log = tmp_path / "log.jsonl"
    train.run(args_for(tmp_path, steps=12, eval_every=6, save="", loss_log=str(log), impl="reference"))
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    steps, vals = [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13)) and [r["step"] for r in vals] == [6, 12]
    for r in steps:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and math.isfinite(r["grad_norm"])
        assert len(r["load_max_mean"]) == 1 and r["load_max_mean"][0] >= 1.0


def test_train_compare_report_on_hand_made_logs(tmp_path, capsys):
    """The fp8 study's report: the baseline's seed band, the mean final loss against it, the late gap over the
    last 10% of steps and the mean gradient norm, on logs whose answers are known."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("train_compare", os.path.join(
        os.path.dirname(__file__), "..", "..", "scripts", "train_compare.py"))
    tc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tc)

    def write(variant, seed, late_loss, final, norm):
        d = tmp_path / "small"
        d.mkdir(exist_ok=True)
        rows = [{"step": s, "loss": 3.0 if s <= 90 else late_loss, "grad_norm": norm} for s in range(1, 101)]
        rows.append({"step": 100, "val_loss": final})
        (d / f"{variant}-s{seed}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("bf16", 0, 2.0, 2.00, 1.0)
    write("bf16", 1, 2.0, 2.02, 1.0)
    write("fp8", 0, 2.01, 2.01, 2.0)  # inside the band [2.00, 2.02]; late gap +0.5%
    write("fp8", 1, 2.01, 2.01, 2.0)
    write("preact-fp8", 0, 2.0, 2.05, 1.0)  # outside
    tc.report(argparse.Namespace(dir=str(tmp_path), study="fp8", png=""))
    summary = json.loads((tmp_path / "summary.json").read_text())["small"]
    assert summary["fp8"]["in_band"] and not summary["preact-fp8"]["in_band"] and summary["bf16"]["in_band"]
    assert summary["fp8"]["late_gap"] == pytest.approx(0.005, abs=1e-5)
    assert summary["preact-fp8"]["late_gap"] == 0 and summary["fp8"]["grad_norm"] == 2.0
    assert summary["fp8"]["vs_baseline"] == pytest.approx(0.0, abs=1e-5)
    assert "outside the band" in capsys.readouterr().out


def test_fsdp_reduce_dtype_is_the_fsdp2_policy_s(monkeypatch):
    """--fsdp-reduce-dtype reaches FSDP2's MixedPrecisionPolicy (bf16 parameters either way)."""
    import moeblaze.distributed
    from moeblaze.cli import parallel

    seen = []
    monkeypatch.setattr(moeblaze.distributed, "parallelize",
                        lambda model, mesh, mp_policy=None, **kw: seen.append(mp_policy) or model)
    ranks = parallel.Ranks(rank=0, world=1, ep=1, device=torch.device("cpu"), mesh=None)
    cfg = ModelConfig(d_model=64, n_layers=2, num_experts=8, top_k=2, d_expert=32)
    for dtype, reduce in (("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("float32", "float32")):
        parallel.parallelize_model("model", ranks, TrainConfig("small", cfg, machine=Machine(dtype=dtype),
                                                               parallel=Parallel(reduce_dtype=reduce)))
    assert [(p.param_dtype, p.reduce_dtype) for p in seen[:2]] == [(torch.bfloat16, torch.float32),
                                                                   (torch.bfloat16, torch.bfloat16)]
    assert seen[2] is None  # float32 parameters: FSDP2's default policy


@pytest.mark.filterwarnings("ignore:token rounding with")
def test_loss_log_says_how_many_pairs_token_rounding_computed(tmp_path):
    """With token rounding the loss log has, per step and layer, the pairs computed per top-k pair: about 1 where
    there are enough tokens per expert, and 0 on a batch so small that the rounding drops every pair."""
    import json

    shares = {}
    for batch, seq in ((8, 32), (1, 8)):
        log = tmp_path / f"log-{batch}.jsonl"
        train.run(args_for(tmp_path, steps=3, eval_every=3, save="", loss_log=str(log), impl="reference",
                           token_rounding="nr-f", batch_size=batch, seq_len=seq))
        shares[batch] = [json.loads(line)["pairs_per_topk"] for line in log.read_text().splitlines()
                         if "grad_norm" in line]
    assert len(shares[8]) == 3 and all(len(s) == 1 and 0.5 <= s[0] <= 1.5 for s in shares[8]), shares
    assert shares[1] == [[0.0]] * 3, shares


@pytest.mark.parametrize("busy,env,torch_loaded,policy", [
    (2.0, {}, False, "passive"),  # other processes keep both cores busy
    (0.1, {}, False, None),  # idle: OpenMP's default (spin) is faster
    (2.0, {"OMP_WAIT_POLICY": "active"}, False, "active"),  # the user's choice stands
    (2.0, {"GOMP_SPINCOUNT": "1000"}, False, None),
    (2.0, {}, True, None),  # too late: OpenMP has read its environment
])
def test_the_command_waits_passively_only_on_a_busy_machine_before_torch_loads(busy, env, torch_loaded, policy):
    code = textwrap.dedent(f"""
        import os, sys
        {"import torch" if torch_loaded else ""}
        import moeblaze.cli as cli
        assert ("torch" in sys.modules) is {torch_loaded}  # the command line's module loads no torch
        cli._busy_cores = lambda: {busy}
        cli.wait_passively_when_busy()
        print(os.environ.get("OMP_WAIT_POLICY"))""")
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(policy)], out.stdout


def test_busy_cores_sees_other_processes():
    """Idle cores read near 0 (this suite's other worker may take up to one); one spinning process reads ~1."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        from moeblaze.cli import _busy_cores

        assert _busy_cores(1.0) >= 0.7
    finally:
        spin.kill()
        spin.wait()


def test_threads_beyond_the_cores_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert main(["train", *TINY, "--save", "", "--threads", "5"]) == 2
    assert "--threads must be at most this machine's 4 cores, got 5" in capsys.readouterr().err


def test_the_run_says_where_it_saved(tmp_path, capsys):
    path = _trained_checkpoint(tmp_path)
    out = capsys.readouterr().out
    assert f"checkpoint of step 4 saved to {path}" in out, out


def test_a_checkpoint_tensor_of_another_shape_is_named_with_both_shapes(tmp_path, capsys):
    path = _trained_checkpoint(tmp_path)
    state = load_checkpoint(path)
    name = next(k for k in state["model"] if k.endswith("w1"))
    old = tuple(state["model"][name].shape)
    state["model"][name] = state["model"][name][..., :-1].clone()
    save_checkpoint(path, state)
    capsys.readouterr()
    assert main(["train", *TINY, "--save", path, "--resume"]) == 2
    err = capsys.readouterr().err
    new = (*old[:-1], old[-1] - 1)
    assert f"{name} has shape {new}, the model's {old}" in err, err


def test_fp8_weight_cache_trains_as_quantizing_every_step(tmp_path):
    """`train --precision fp8 --fp8-weight-cache` under its fused AdamW (whose kernel moves no version counter):
    each step's loss and gradient norm equal, bit for bit, those of the run that quantizes the weights where used,
    so no step reads the e4m3 copies of the weights before an update."""
    import json

    logs = []
    for cache in (False, True):
        log = tmp_path / f"log-{cache}.jsonl"
        train.run(args_for(tmp_path, steps=3, eval_every=3, eval_batches=1, batch_size=2, seq_len=16, save="",
                           loss_log=str(log), impl="triton", d_model=128, d_expert=64, precision="fp8",
                           fp8_min_rows=0, fp8_weight_cache=cache))
        logs.append([json.loads(line) for line in log.read_text().splitlines()])
    assert logs[0] == logs[1]
    losses = [r["loss"] for r in logs[0] if "loss" in r]
    assert len(losses) == 3 and len(set(losses)) > 1  # the weights did change between steps


@pytest.mark.parametrize("world,ep", [(1, 1), (2, 1)])
def test_fp8_weight_cache_under_fsdp2_is_refused_before_any_work(tmp_path, monkeypatch, capsys, world, ep):
    """Under torchrun, wherever FSDP2 gathers the experts (one process included: FSDP2 runs there too), the
    command refuses --fp8-weight-cache in one line, by distributed.fsdp's rule, before it builds the model."""
    def no_work(*a, **k):
        raise AssertionError("the model was built before the arguments were checked")

    monkeypatch.setattr(train, "MoEModel", no_work)
    monkeypatch.setattr(parallel, "launched", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    flags = ["--precision", "fp8", "--fp8-weight-cache", "--ep", str(ep)]
    assert main(["train", *TINY, "--save", str(tmp_path / "ck"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeblaze train: error: --fp8-weight-cache: fp8_weight_cache=True under FSDP2")
    assert "\n" not in err and os.listdir(tmp_path) == []


def test_the_parallel_layout_left_to_rule(monkeypatch):
    """Under torchrun with no layout flag: FSDP2 alone, kept gathered, bf16 reductions where the experts' weights
    take at most an eighth of the GPU's memory; ep = N where they don't; flags given win; off a GPU, FSDP2 regathered
    in float32."""
    from moeblaze.cli import parallel

    cfg = ModelConfig(d_model=64, n_layers=2, num_experts=8, top_k=2, d_expert=32)
    weights = parallel._experts_bytes(cfg, "bfloat16")
    assert weights == 2 * 8 * (2 * 32 + 32) * 64 * 2

    def config(**kw):
        par = dict(ep=None, keep_gathered="auto", reduce_dtype="auto")
        mach = dict(dtype="bfloat16", device="cuda")
        par.update({k: v for k, v in kw.items() if k in par})
        mach.update({k: v for k, v in kw.items() if k in mach})
        return TrainConfig("small", cfg, machine=Machine(**mach), parallel=Parallel(**par))

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(parallel, "_gpu_memory", lambda device: 8 * weights)  # fits: exactly an eighth
    a, note = parallel.choose_layout(config(), True)
    assert (a.parallel.ep, a.parallel.keep_gathered, a.parallel.reduce_dtype) == (1, True, "bfloat16"), note
    assert "ep 1" in note and "kept" in note and "bfloat16" in note
    monkeypatch.setattr(parallel, "_gpu_memory", lambda device: 8 * weights - 1)  # doesn't fit: ep = N
    a, _ = parallel.choose_layout(config(), True)
    assert (a.parallel.ep, a.parallel.keep_gathered) == (4, False)
    a, note = parallel.choose_layout(config(ep=2, keep_gathered="no", reduce_dtype="float32"), True)  # the flags win
    assert note == ""
    assert (a.parallel.ep, a.parallel.keep_gathered, a.parallel.reduce_dtype) == (2, False, "float32")
    monkeypatch.setattr(parallel, "_gpu_memory", lambda device: None)  # the CPU: nothing to fit in
    a, _ = parallel.choose_layout(config(device="cpu", dtype="float32"), True)
    assert (a.parallel.ep, a.parallel.keep_gathered, a.parallel.reduce_dtype) == (1, False, "float32")


def test_save_and_overwrite_say_what_they_would_replace(tmp_path):
    """--save naming a file that is not a checkpoint is refused by name, also with --overwrite (moeblaze replaces
    only its own); --overwrite with nothing at --save, or with --save '', is refused: each before any work."""
    from moeblaze.cli import main

    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint\n")
    for extra in ([], ["--overwrite"]):
        assert main(["train", *TINY, "--save", str(notes), *extra]) == 2
    assert notes.read_text() == "not a checkpoint\n"
    assert main(["train", *TINY, "--save", str(tmp_path / "none.pt"), "--overwrite"]) == 2
    assert not (tmp_path / "none.pt").exists()
    assert main(["train", *TINY, "--save", "", "--overwrite"]) == 2


def test_a_capacity_tracker_checks_its_fields_where_it_is_made():
    from moeblaze.distributed import CapacityTracker

    for bad, error in ((16.5, TypeError), ("16", TypeError), (0, ValueError), (True, TypeError)):
        with pytest.raises(error, match="capacity must be"):
            CapacityTracker(bad)
    with pytest.raises(ValueError, match="multiple must be"):
        CapacityTracker(16, multiple=0)


def test_a_refused_output_leaves_no_folder_behind(tmp_path, monkeypatch):
    """--loss-log that can't be written is refused after --save's folder was probed: the run leaves no empty
    checkpoints/ folder behind (nor any folder a probe made)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("")
    assert main(["train", *TINY, "--loss-log", str(tmp_path / "file" / "l.jsonl")]) == 2
    assert sorted(os.listdir(tmp_path)) == ["file"]
    assert main(["train", *TINY, "--save", "a/b/c.pt", "--loss-log", str(tmp_path / "file" / "l.jsonl")]) == 2
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_the_header_names_the_kernels_expert_parallelism_runs():
    """Under --ep the experts run on the Triton kernels (backend auto resolves to them), which the CPU header says;
    on one process auto is the PyTorch reference there."""
    from dataclasses import replace

    from moeblaze import ExpertsConfig, ModelConfig
    from moeblaze.cli.train_setup import experts_path

    cfg = ModelConfig()
    assert experts_path(cfg, 1).startswith("the PyTorch reference")
    assert experts_path(cfg, 2).startswith("the Triton kernels")
    assert experts_path(replace(cfg, experts=ExpertsConfig(backend="reference")), 2).startswith("the PyTorch reference")


def test_ep_wire_reaches_the_ep_config_and_needs_ep():
    p = argparse.ArgumentParser()
    train_flags.add_arguments(p)
    assert train_flags.ep_config(p.parse_args(["--ep", "2", "--ep-wire", "e4m3"])).wire == "e4m3"
    assert train_flags.ep_config(p.parse_args(["--ep", "2"])).wire == "native"
    with pytest.raises(ValueError, match="--ep-wire e4m3 needs --ep > 1"):
        train_flags.ep_config(p.parse_args(["--ep", "1", "--ep-wire", "e4m3"]))
