"""`moeblaze bench` and `moeblaze profile` on the CPU at tiny sizes (the reference, the conventional
pipeline and the Triton kernels under the interpreter)."""
import glob
import json
import os
import re
import sys

import pytest
import torch

from moeblaze.bench import harness
from moeblaze.cli import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import report  # noqa: E402  (benchmarks/report.py: the charts and the results page, outside the package)
from report import results_markdown, update_report  # noqa: E402

START, END = "<!-- results:start -->", "<!-- results:end -->"  # the results page's markers

ROW_FIELDS = {"impl", "policy", "L", "d", "h", "E", "K", "activation", "dtype", "fwd_ms", "step_ms", "host_ms",
              "kept_mb", "peak_mb", "tflops", "rel_err", "gpu", "torch", "triton", "git_sha", "run_id", "command",
              "date", "status", "mode"}


def read_rows(out):
    (path,) = glob.glob(os.path.join(out, "*.jsonl"))
    return [json.loads(line) for line in open(path)]


def test_layer_bench_rows_schema_and_plot(tmp_path):
    out = str(tmp_path)
    assert main(["bench", "--config", "48,32,16,4,2", "--impls", "moeblaze,reference,torch_gmm", "--out", out,
                 "--warmup", "0", "--iters", "1"]) == 0
    assert report.main([out, "--plot"]) == 0
    rows = read_rows(out)
    assert [(r["impl"], r["policy"]) for r in rows] == [("moeblaze", "preact"), ("moeblaze", "recompute"),
                                                       ("reference", "-"), ("torch_gmm", "-")]
    assert len({r["run_id"] for r in rows}) == 1
    for r in rows:
        assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
        assert r["status"] == "ok" and r["step_ms"] > 0 and r["fwd_ms"] > 0 and r["kept_mb"] > 0
        assert 0 < r["host_ms"] <= r["step_ms"]  # on the CPU it is timed inside the step's own window
        assert set(r["rel_err"]) == {"out", "dx", "dw1", "dw2", "dtopk_w"}
        # fp32 on the CPU against the fp32 reference: sums of at most 32 terms in another order (a few ulps, 2^-23)
        assert max(r["rel_err"].values()) < 1e-5
        assert r["tflops"] == pytest.approx(18 * 48 * 2 * 32 * 16 / (r["step_ms"] * 1e-3) / 1e12)
    # preact keeps H (L·K x 2h fp32) beyond the index; recompute keeps the index only
    kept = {r["policy"]: r["kept_mb"] * 2 ** 20 for r in rows if r["impl"] == "moeblaze"}
    assert kept["preact"] - kept["recompute"] == 48 * 2 * 32 * 4
    assert glob.glob(os.path.join(out, "layer-*.png"))


def test_fp8_bench_with_the_weight_cache_pays_one_quantization_a_step(tmp_path, monkeypatch):
    """moeblaze-e4m3-cached: the same errors as moeblaze-e4m3 (the same arithmetic), and each timed step quantizes
    both weights once (the bench moves their versions on before each step, as an optimizer step would)."""
    from moeblaze.experts import quant

    calls = []
    real = quant.quantize_blocks
    monkeypatch.setattr(quant, "quantize_blocks", lambda w, transpose=False, both=False: (
        calls.append(both), real(w, transpose, both))[1])
    out = str(tmp_path)
    assert main(["bench", "--config", "48,32,16,4,2", "--impls", "moeblaze-e4m3,moeblaze-e4m3-cached", "--policies",
                 "preact", "--out", out, "--warmup", "0", "--iters", "1"]) == 0
    rows = {r["impl"]: r for r in read_rows(out)}
    assert rows["moeblaze-e4m3"]["status"] == rows["moeblaze-e4m3-cached"]["status"] == "ok"
    assert rows["moeblaze-e4m3"]["rel_err"] == rows["moeblaze-e4m3-cached"]["rel_err"]
    assert calls.count(True) > 0 and calls.count(True) % 2 == 0  # W1 and W2, both layouts, once per step
    p = harness.make_problem(48, 32, 16, 4, 2, "swiglu", dtype=torch.float32, device="cpu", n_sets=1)
    calls.clear()
    call = harness.IMPLS["moeblaze-e4m3-cached"][2](p, "preact")
    for i in range(3):
        harness.run_step(call, p, i, backward=True)
    assert calls == [True, True] * 3


def test_bench_precision_fp8_adds_the_fp8_rows(tmp_path):
    """`moeblaze bench --precision fp8`: moeblaze-fp8 joins the named implementations with its own policies."""
    out = str(tmp_path)
    assert main(["bench", "--config", "48,32,16,4,2", "--impls", "reference", "--precision", "fp8", "--out", out,
                 "--warmup", "0", "--iters", "1", "--no-ref"]) == 0
    rows = read_rows(out)
    assert [(r["impl"], r["policy"]) for r in rows] == [("reference", "-"), ("moeblaze-fp8", "preact"),
                                                       ("moeblaze-fp8", "preact-fp8")]
    assert all(r["status"] == "ok" for r in rows)


def test_scale_records_oom_and_keeps_going(tmp_path, monkeypatch):
    def oom_past_64_tokens(p, policy):
        def call(x, idx, w, w1, w2):
            if p.L > 64:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return harness.torch_gmm_experts(x, idx, w, w1, w2, p.activation)
        return call

    monkeypatch.setitem(harness.IMPLS, "torch_gmm", (lambda: True, ("-",), oom_past_64_tokens))
    out = str(tmp_path)
    main(["bench", "--scale", "--scale-config", "0,32,16,4,2", "--min-tokens", "32", "--max-tokens", "256",
          "--impls", "reference,torch_gmm", "--out", out, "--warmup", "0", "--iters", "1"])
    report.main([out, "--plot"])
    rows = read_rows(out)
    gmm = [(r["L"], r["status"]) for r in rows if r["impl"] == "torch_gmm"]
    assert gmm == [(32, "ok"), (64, "ok"), (128, "oom")]  # stops after its first oom
    assert [r["L"] for r in rows if r["impl"] == "reference"] == [32, 64, 128, 256]
    assert all(r["mode"] == "scale" for r in rows)
    assert glob.glob(os.path.join(out, "scale-*.png"))


def test_a_failing_implementation_is_reported_not_fatal(tmp_path, monkeypatch):
    def broken(p, policy):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(harness.IMPLS, "torch_gmm", (lambda: True, ("-",), broken))
    out = str(tmp_path)
    main(["bench", "--config", "32,16,16,4,2", "--impls", "torch_gmm,reference", "--out", out, "--iters", "1",
          "--warmup", "0"])
    status = {r["impl"]: r["status"] for r in read_rows(out)}
    assert status == {"torch_gmm": "error: RuntimeError: kernel exploded", "reference": "ok"}


def test_an_implementation_failing_while_timed_is_reported_not_fatal(tmp_path, monkeypatch):
    """It compiles and passes its checks, then fails in the interleaved timing rounds: its row says why,
    the others are timed."""
    calls = []

    def fails_once_timed(p, policy):
        ref = harness.IMPLS["reference"][2](p, policy)

        def call(*args):
            calls.append(1)
            if len(calls) >= 6:  # an error check, a compiling step, 2 warm-up steps, a forward for memory
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return ref(*args)
        return call

    monkeypatch.setitem(harness.IMPLS, "torch_gmm", (lambda: True, ("-",), fails_once_timed))
    out = str(tmp_path)
    main(["bench", "--config", "32,16,16,4,2", "--impls", "torch_gmm,reference", "--out", out, "--iters", "2"])
    rows = {r["impl"]: r for r in read_rows(out)}
    assert rows["torch_gmm"]["status"] == "oom" and rows["torch_gmm"]["kept_mb"] is not None
    assert rows["reference"]["status"] == "ok" and rows["reference"]["step_ms"] > 0


def test_a_stalled_implementation_shows_where_it_waits(tmp_path, monkeypatch, capfd):
    """Past --stall-s, every thread's stack goes to stderr (a peer's JIT that hangs names its frame) and
    the run goes on."""
    import time

    def compile_that_stalls(p, policy):
        time.sleep(1.5)
        return harness.IMPLS["reference"][2](p, policy)

    monkeypatch.setitem(harness.IMPLS, "torch_gmm", (lambda: True, ("-",), compile_that_stalls))
    out = str(tmp_path)
    main(["bench", "--config", "32,16,16,4,2", "--impls", "torch_gmm", "--out", out, "--iters", "1",
          "--warmup", "0", "--stall-s", "0.5"])
    captured = capfd.readouterr()
    assert "compile_that_stalls" in captured.err
    assert re.search(r"torch_gmm +- \| compiled, checked, memory measured \(\d+ s\)", captured.out)
    assert read_rows(out)[0]["status"] == "ok"


def test_dispatch_rows(tmp_path):
    out = str(tmp_path)
    main(["bench", "--dispatch", "--dispatch-L", "200", "--dispatch-E", "4,16", "--dispatch-K", "1,8", "--out", out])
    rows = read_rows(out)
    assert [(r["E"], r["K"]) for r in rows] == [(4, 1), (16, 1), (16, 8)]  # K > E is skipped
    for r in rows:
        assert r["status"] == "ok" and set(r["dispatch_ms"]) == {"dense", "sort", "argsort_bincount_cumsum"}


def test_readme_results_section(tmp_path):
    rows = [dict(mode="layer", impl=i, policy=p, L=64, d=32, h=16, E=4, K=2, activation="swiglu", dtype="bfloat16",
                 fwd_ms=1.0, step_ms=s, kept_mb=k, peak_mb=2 * k, tflops=1.0, rel_err={"out": 1e-3}, gpu="Test GPU",
                 torch="t", triton="tr", git_sha="abc", run_id="r1", command="moeblaze bench", date="2026-01-01",
                 status="ok") for i, p, s, k in (("moeblaze", "preact", 2.0, 10.0), ("sonicmoe", "-", 3.0, 10.0))]
    rows[0]["host_ms"] = 0.5  # the sonicmoe row is from before host_ms: its cell reads "-"
    (tmp_path / "res").mkdir()
    with open(tmp_path / "res" / "test-gpu.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{START}\nold\n{END}\ntail\n")
    update_report(str(readme), str(tmp_path / "res"))
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{END}\ntail\n")
    assert "| 64,32,16,4,2 | moeblaze/preact | 1.00 | 2.00 | 0.50 | - | 1.50 | - |" in text  # 3.0 / 2.0 vs SonicMoE
    assert "| 64,32,16,4,2 | sonicmoe | 1.00 | 3.00 | - | - | 1.00 | - |" in text
    assert not os.path.exists(tmp_path / "res" / "headline.png")  # a run without every headline series makes none
    assert "No GPU results" in results_markdown([])


def test_the_headline_comes_from_the_newest_run_with_every_series(tmp_path):
    """The front page's chart: the newest run that measured every headline series at each of its configs."""
    from report import HEADLINE, headline_run, plot_headline

    def rows(run, date, series):
        return [dict(mode="layer", impl=i, policy=p, L=64, d=32, h=16, E=4, K=2, dtype="bfloat16", gpu="G",
                     git_sha="abc", run_id=run, date=date, step_ms=2.0, kept_mb=1.0, peak_mb=4.0, status="ok")
                for (i, p), _ in series]
    whole, partial = rows("whole", "2026-01-01", HEADLINE), rows("newer", "2026-02-01", HEADLINE[:-1])
    assert {r["run_id"] for r in headline_run(whole + partial)} == {"whole"}
    assert plot_headline(whole + partial, str(tmp_path / "h.png")) == str(tmp_path / "h.png")
    assert os.path.getsize(tmp_path / "h.png") > 0
    assert plot_headline(partial, str(tmp_path / "none.png")) is None


def test_the_performance_page_s_table_is_the_headline_run_s(tmp_path):
    """docs/performance.md's summary (the "standing" section): the headline run's steps, kernel times and peaks;
    the fp8 cell says where the rule ran bf16 (no e4m3 launch); a page with no section is refused by name."""
    from report import HEADLINE

    def row(i, p, step, busy, peak, L=64, launches=()):
        return dict(mode="layer", impl=i, policy=p, L=L, d=32, h=16, E=4, K=2, dtype="bfloat16", gpu="G", torch="t",
                    triton="tr", git_sha="abc", run_id="r1", command="moeblaze bench", date="2026-01-01",
                    step_ms=step, gpu_busy_ms=busy, kept_mb=1.0, peak_mb=peak, status="ok", launches=list(launches))
    rows = []
    for L, fp8_launch in ((64, ["fp8_rows:gluon"]), (128, ["up:gluon"])):
        for n, ((i, p), _) in enumerate(HEADLINE):
            rows.append(row(i, p, 10.0 + n, 9.0 + n, 100.0 * (n + 1), L, fp8_launch if i == "moeblaze-fp8" else ()))
    (tmp_path / "res").mkdir()
    with open(tmp_path / "res" / "g.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    page = tmp_path / "performance.md"
    page.write_text("# p\n<!-- standing:start -->\nold\n<!-- standing:end -->\ntail\n")
    update_report(str(page), str(tmp_path / "res"))
    text = page.read_text()
    assert "old" not in text and "run r1 (commit abc" in text and text.endswith("<!-- standing:end -->\ntail\n")
    # HEADLINE's order: torch_gmm, sonicmoe, moeblaze bf16, moeblaze-fp8, recompute
    assert ("| 64,32,16,4,2 | 12.00 (11.00) | 11.00 (10.00) | 10.00 (9.00) | 13.00 (12.00) | 300 / 200 / 100 / 400 |"
            in text)
    assert "| 128,32,16,4,2 | 12.00 (11.00) | 11.00 (10.00) | 10.00 (9.00) | 13.00 (bf16 by the rule) |" in text
    assert not os.path.exists(tmp_path / "res" / "headline.png")  # charts belong to the results page
    page.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="no generated section"):
        update_report(str(page), str(tmp_path / "res"))


def test_profile_layer_compares_with_conventional(capsys):
    res = main(["profile", "--tokens", "64", "--d-model", "32", "--d-expert", "32", "--num-experts", "4"])
    assert res == 0
    text = capsys.readouterr().out
    assert "(functional):fused_experts " in text and "fewer bytes for backward" in text


def test_profile_numbers(capsys):
    import argparse

    from moeblaze.cli import profile, profile_flags

    p = argparse.ArgumentParser()
    profile_flags.add_arguments(p)
    args = p.parse_args(["--tokens", "64", "--d-model", "32", "--d-expert", "32", "--num-experts", "4",
                         "--backend", "triton"])
    res = profile.run(profile_flags.check_flags(args))
    ours, conv = res["moeblaze"], res["torch_gmm"]
    # moeblaze keeps H (64·2 pairs x 64 fp32), three index arrays (token ids and slots of the 128 pairs,
    # 5 offsets) and the tile schedule (2 x (128 // 16 + 4) tiles + the used count); the conventional
    # pipeline far more
    assert ours["saved_bytes"] == 64 * 2 * 64 * 4 + 4 * (2 * 64 * 2 + 5) + 4 * (2 * (128 // 16 + 4) + 1)
    assert conv["saved_bytes"] > 2 * ours["saved_bytes"]


def test_profile_model(capsys):
    assert main(["profile", "--target", "model", "--tokens", "64", "--d-model", "32", "--d-expert", "32",
                 "--num-experts", "4", "--backend", "reference"]) == 0
    assert "MoEModel" in capsys.readouterr().out


def test_stage_times_cover_every_launch_of_a_step():
    from moeblaze.bench.stages import stage_times

    rows = stage_times(40, 24, 40, 4, 2, dtype=torch.float32, device="cpu", iters=1)
    names = [r[0].split(":")[0] for r in rows]
    assert names == ["up", "down", "combine", "down_bwd", "dW2", "dW1", "dX~", "dx"]
    assert all(ms > 0 and host_us > 0 for _, ms, host_us, *_ in rows)
    # GEMM stages carry a rate; the gather-sums don't
    assert [r[3] is not None for r in rows] == [True, True, False, True, True, True, True, False]
    # each GEMM stage names the tl config it ran with (the Gluon kernels never run on the CPU)
    assert all("BLOCK_N" in r[4] for r in rows if r[3] is not None)


def test_results_take_the_newest_run_beside_sonicmoe():
    from report import latest_rows

    def row(impl, run, date, step):
        return dict(mode="layer", impl=impl, policy="preact" if impl == "moeblaze" else "-", L=64, d=32, h=16, E=4,
                    K=2, gpu="G", run_id=run, date=date, step_ms=step, status="ok")
    rows = [row(i, "old", "2026-01-01", 2.0) for i in ("moeblaze", "sonicmoe", "liger", "torch_gmm")]
    rows += [row(i, "new", "2026-02-01", 1.0) for i in ("moeblaze", "sonicmoe")]
    rows += [row(i, "newest", "2026-03-01", 0.5) for i in ("moeblaze", "torch_gmm", "liger")]  # no SonicMoE
    assert {r["run_id"] for r in latest_rows(rows, "layer")} == {"new"}
    assert {r["run_id"] for r in latest_rows(rows[-3:], "layer")} == {"newest"}


def test_results_compare_each_repeat_with_sonicmoe_of_the_same_repeat():

    def row(impl, step):
        return dict(mode="layer", impl=impl, policy="preact" if impl == "moeblaze" else "-", L=64, d=32, h=16, E=4,
                    K=2, activation="swiglu", dtype="bfloat16", gpu="G", torch="t", triton="t", git_sha="s",
                    command="c", run_id="r", date="2026-01-01", fwd_ms=1.0, step_ms=step, tflops=1.0, kept_mb=1.0,
                    peak_mb=1.0, rel_err=None, status="ok")
    rows = [row("moeblaze", 3.0), row("sonicmoe", 1.5), row("moeblaze", 2.0), row("sonicmoe", 4.0)]
    rows[0]["gpu_busy_ms"] = 2.5  # from a run with --gpu-busy
    table = [line for line in results_markdown(rows).splitlines() if line.startswith("| 64,")]
    assert table == [
        "| 64,32,16,4,2 (repeat 1) | moeblaze/preact | 1.00 | 3.00 | - | 2.50 | 0.50 | - | 1 | 1 | 1 | - |",
        "| 64,32,16,4,2 (repeat 1) | sonicmoe | 1.00 | 1.50 | - | - | 1.00 | - | 1 | 1 | 1 | - |",
        "| 64,32,16,4,2 (repeat 2) | moeblaze/preact | 1.00 | 2.00 | - | - | 2.00 | - | 1 | 1 | 1 | - |",
        "| 64,32,16,4,2 (repeat 2) | sonicmoe | 1.00 | 4.00 | - | - | 1.00 | - | 1 | 1 | 1 | - |",
    ]


def test_results_show_one_run_and_no_older_rows_of_other_implementations():
    """The layer table is the rows of one run per config (the newest beside SonicMoE): an implementation only an
    older run measured is not listed beside it (its numbers are of other code)."""

    def row(impl, run, date, step, policy="-"):
        return dict(mode="layer", impl=impl, policy=policy, L=64, d=32, h=16, E=4, K=2, activation="swiglu",
                    dtype="bfloat16", gpu="G", torch="t", triton="t", git_sha="s", command="c", run_id=run, date=date,
                    fwd_ms=1.0, step_ms=step, tflops=1.0, kept_mb=1.0, peak_mb=1.0, rel_err=None, status="ok")
    rows = [row("liger", "peer", "2026-01-02", 8.0, "pinned"), row("torch_gmm", "peer", "2026-01-02", 4.0),
            row("moeblaze", "main", "2026-01-03", 2.0, "preact"), row("sonicmoe", "main", "2026-01-03", 1.0),
            row("torch_gmm", "main", "2026-01-03", 3.0)]
    text = results_markdown(rows)
    assert "run main" in text and "run peer" not in text and "liger" not in text
    assert "| 64,32,16,4,2 | moeblaze/preact | 1.00 | 2.00 | - | - | 0.50 | 1.50 | 1 | 1 | 1 | - |" in text


def test_results_rows_record_no_absolute_paths():
    """The command a row records names an absolute path (the output folder of the machine that ran it) by its
    last part only; relative arguments stay as given."""
    from moeblaze.cli.bench import run_env

    env = run_env(torch.device("cpu"),
                  "python benchmarks/experiments/rounding/rounding_bench.py --out /some/machine/out/ --configs E256")
    assert env["command"] == "python benchmarks/experiments/rounding/rounding_bench.py --out out --configs E256"
    assert run_env(torch.device("cpu"), "moeblaze bench --out bench/results")["command"] == \
        "moeblaze bench --out bench/results"


def test_profile_refuses_gluon_on_the_cpu_before_any_work(capsys):
    """Hopper's Gluon kernels can't run under the CPU's interpreter: one line, exit 2, nothing run."""
    from moeblaze.cli import main

    assert main(["profile", "--device", "cpu", "--backend", "gluon"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "--backend gluon" in err[0] and "on the CPU use --backend triton" in err[0], err
    assert "moeblaze profile: on the CPU" not in captured.out


def test_a_dispatch_sweep_that_is_not_integers_is_refused_by_its_flag(capsys):
    """--dispatch-L/E/K are comma lists of positive integers, refused in one line before any work."""
    for flag, value in (("--dispatch-L", "8k"), ("--dispatch-E", "8,,16"), ("--dispatch-K", "0")):
        assert main(["bench", "--dispatch", flag, value]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"moeblaze bench: error: {flag}: expected a comma list of positive integers, got {value!r}"), err
