"""What a newcomer's first commands do: a bare `moeblaze` starts nothing, a misspelled flag is named by its
command with the nearest flag, a run never replaces a checkpoint unasked, every refusal is one `moeblaze SUB:
error:` line with status 2 before any work, a precision the run cannot use is said, and `bench` / `profile` on
the CPU show the kernels (under Triton's interpreter) at a shape that finishes in seconds."""
import argparse
import json
import os
import subprocess
import sys

import pytest

from moeblaze.cli import main, parser

TINY = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--d-model", "16", "--n-layers", "1", "--n-heads", "2",
        "--num-experts", "4", "--d-expert", "16", "--eval-batches", "1", "--eval-every", "2"]


def test_a_bare_moeblaze_prints_its_help_and_starts_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: moeblaze" in out and all(c in out for c in ("train", "bench", "profile"))
    assert os.listdir(tmp_path) == []  # no checkpoint, no results


def test_a_misspelled_flag_is_named_by_its_command_with_the_nearest_one(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--stpes", "10"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moeblaze train: error: unrecognized arguments: --stpes 10"), err
    assert "did you mean --steps?" in err[0]


def test_train_help_is_grouped():
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    titles = [g.title for g in sub._action_groups if g._group_actions]
    for title in ("model", "experts (moeblaze.ExpertsConfig)", "training", "checkpoint",
                  "several processes (torchrun --nproc-per-node N)", "benchmark"):
        assert title in titles, titles
    loose = [a.option_strings[0] for g in sub._action_groups if g.title == "options" for a in g._group_actions
             if a.option_strings[0] != "-h"]
    assert loose == [], loose


def test_bench_help_is_grouped():
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    titles = [g.title for g in sub._action_groups if g._group_actions]
    for title in ("timing", "the token sweep (--scale)", "end to end in transformers models (--hf)", "results"):
        assert title in titles, titles
    loose = [a.option_strings[0] for g in sub._action_groups if g.title == "options" for a in g._group_actions
             if a.option_strings[0] != "-h"]
    assert loose == [], loose


def test_a_run_never_replaces_a_checkpoint_unasked(tmp_path, capsys):
    path = tmp_path / "ck.pt"
    assert main(["train", *TINY, "--save", str(path)]) == 0
    before = path.read_bytes()
    capsys.readouterr()
    assert main(["train", *TINY, "--save", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeblaze train: error: --save:") and "--resume" in err and "--overwrite" in err, err
    assert path.read_bytes() == before
    assert main(["train", *TINY, "--save", str(path), "--resume", "--overwrite"]) == 2
    assert "choose one" in capsys.readouterr().err
    assert main(["train", *TINY, "--seed", "1", "--save", str(path), "--overwrite"]) == 0
    assert path.read_bytes() != before


def test_resume_of_a_file_that_is_no_checkpoint_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    from moeblaze.cli import train

    path = tmp_path / "notes.txt"
    path.write_text("not a checkpoint\n")
    monkeypatch.setattr(train, "MoEModel", lambda *a: pytest.fail("the model was built before --resume was checked"))
    assert main(["train", *TINY, "--save", str(path), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"moeblaze train: error: --resume: {path} is not a moeblaze checkpoint (no 'moeblaze-checkpoint 1' "
                   "header): written by another program, or its first bytes are damaged"], err


def test_a_precision_the_run_cannot_use_is_said(capsys):
    assert main(["train", *TINY, "--save", "", "--precision", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "--precision fp8 runs native precision here: the experts average 16 rows per call, fewer than " \
           "--fp8-min-rows 2048" in out, out
    assert main(["train", *TINY, "--save", "", "--fp8-min-rows", "0"]) == 2
    assert "fp8_min_rows=0 applies to precision='fp8'" in capsys.readouterr().err


def test_the_deprecated_impl_flag_says_so_once(capsys):
    assert main(["train", *TINY, "--save", "", "--impl", "reference"]) == 0
    err = capsys.readouterr().err
    assert err.count("note: --impl is deprecated and goes in 0.3: say --backend reference") == 1, err


def test_dense_layers_leave_a_moe_layer(capsys):
    assert main(["train", *TINY, "--save", "", "--dense-layers", "1"]) == 2
    assert "dense_layers must be < n_layers (1)" in capsys.readouterr().err


def test_bench_and_profile_on_the_cpu_turn_the_interpreter_on():
    """Set before triton loads, where nothing set it and no GPU runs the command."""
    code = ("import os\nfrom moeblaze.cli import interpret_on_the_cpu\n"
            "interpret_on_the_cpu('cpu')\n"
            "print(os.environ.get('TRITON_INTERPRET'))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "1", out.stderr


def test_bench_on_the_cpu_measures_a_small_shape(tmp_path, capsys):
    """The default configs on the CPU: one shape the interpreter runs in seconds, with the kernels' rows."""
    from moeblaze.bench.names import CPU_CONFIG

    assert main(["bench", "--out", str(tmp_path), "--impls", "moeblaze,torch_gmm", "--policies", "recompute",
                 "--stall-s", "0"]) == 0
    rows = [json.loads(line) for line in open(tmp_path / "cpu.jsonl")]
    assert {(r["impl"], r["status"]) for r in rows} == {("moeblaze", "ok"), ("torch_gmm", "ok")}
    assert all((r["L"], r["d"], r["h"], r["E"], r["K"]) == CPU_CONFIG[1] for r in rows)
    kept = {r["impl"]: r["kept_mb"] for r in rows}
    assert kept["moeblaze"] < kept["torch_gmm"] / 10, kept  # recompute keeps the index alone
    assert "kernels run under Triton's interpreter" in capsys.readouterr().out


def test_the_readme_commands_in_order_in_one_folder(tmp_path):
    """The README's train command, then the tests, in one folder: the checkpoint the first leaves in checkpoints/
    changes nothing for the second (each test works in its own folder); here the train command with a tiny step
    count, then the test that once failed after it."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": tests}
    train = subprocess.run([sys.executable, "-m", "moeblaze.cli", "train", "--steps", "2", "--eval-every", "2"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert train.returncode == 0, train.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "moeblaze.pt").is_file()
    suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            os.path.join(tests, "cli", "test_train.py") + "::test_every_output_path_fails_up_front"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert suite.returncode == 0, suite.stdout[-3000:]


def test_version_says_the_version_and_starts_nothing(capsys):
    from moeblaze import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"moeblaze {__version__}"
