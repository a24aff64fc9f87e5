"""scripts/scaling_report.py: efficiency against the matching one-GPU run, medians over repeats, ep = N joined
across N, no efficiency without a one-GPU run, and the plot drawn."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import scaling_report  # noqa: E402


def _row(world, step_ms, ep=1, units="blocks", dispatch="-", graph=False, preset="small", **extra):
    tokens = 2048
    return dict(mode="train", status="ok", preset=preset, world=world, ep=ep, efsdp=world // ep, dispatch=dispatch,
                fsdp_units=units, keep_gathered=False, compiled=False,
                cuda_graph=graph, dtype="bfloat16", batch_per_gpu=16, seq=128, step_ms=step_ms,
                tokens_s_per_gpu=tokens / step_ms * 1e3, peak_gb=0.3, loss=3.4, git_sha="abc1234", **extra)


def test_entries_take_medians_and_measure_against_the_matching_one_gpu_run(tmp_path, capsys):
    rows = [_row(1, 10.0, units="-"), _row(1, 12.0, units="-"), _row(1, 14.0, units="-"),  # median 12
            _row(1, 1.0, units="-", graph=True),
            _row(2, 13.0), _row(2, 15.0), _row(4, 16.0),
            _row(2, 24.0, ep=2, dispatch="capacity", capacity_factor=1.25),
            _row(4, 48.0, ep=4, dispatch="capacity", capacity_factor=1.25),
            _row(4, 20.0, ep=2, dispatch="exact"),
            _row(2, 1.25, graph=True, units="model"),
            _row(8, 30.0, ep=8, dispatch="exact", preset="deepseek-v3-layer"),
            dict(mode="dispatch", step_ms=1.0)]  # not a training row
    es = {(e["preset"], e["graph"], e["world"], e["layout"]): e for e in scaling_report.entries(rows)}
    one = es[("small", False, 1, "-")]
    assert (one["runs"], one["step_ms"], one["efficiency"]) == (3, 12.0, 1.0)
    fsdp2 = es[("small", False, 2, "FSDP2 (ep 1)")]
    # efficiencies are one or two float divisions of the rows' times: equal to a few ulps (2^-52), 1e-12 holds them
    assert fsdp2["runs"] == 2 and fsdp2["step_ms"] == 14.0 and abs(fsdp2["efficiency"] - 12 / 14) < 1e-12
    assert abs(es[("small", False, 4, "FSDP2 (ep 1)")]["efficiency"] - 0.75) < 1e-12
    assert abs(es[("small", False, 2, "ep N, capacity 1.25")]["efficiency"] - 0.5) < 1e-12
    assert ("small", False, 4, "ep N, capacity 1.25") in es and ("small", False, 4, "ep 2, exact") in es
    # the graphed run against the graphed one-GPU run, not the eager one
    assert abs(es[("small", True, 2, "FSDP2 (ep 1), one unit")]["efficiency"] - 0.8) < 1e-12
    assert es[("deepseek-v3-layer", False, 8, "ep N, exact")]["efficiency"] is None

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = tmp_path / "scaling.png"
    assert scaling_report.main([str(path), "--png", str(png)]) == 0
    table = capsys.readouterr().out
    assert "| small, 16 x 128 | 2 | FSDP2 (ep 1) | 2 | 14.00 | 146,286 | 0.86 |" in table
    assert "| deepseek-v3-layer, 16 x 128 | 8 | ep N, exact | 1 | 30.00 | 68,267 | - |" in table
    assert png.stat().st_size > 10_000
    assert scaling_report.main([str(path), "--sha", "other"]) == 1  # no rows of that commit: said, not an empty table


def _titan(variant, world, tokens_per_s, ep=1, batch=4):
    return dict(variant=variant, batch=batch, seq=4096, steps=20, world=world, ep=ep, tokens_per_s=tokens_per_s,
                step_ms=1.0, peak_gib=50.0, loss_first=12.0, loss_last=8.0)


def test_titan_table_scales_against_one_gpu_and_compares_with_torchtitans_experts(tmp_path, capsys):
    rows = [_titan("default", 1, 50_000), _titan("preact", 1, 60_000),
            _titan("default", 4, 176_000), _titan("preact", 4, 220_000),  # FSDP2
            _titan("default", 4, 148_000, ep=4), _titan("preact+exact", 4, 204_000, ep=4),
            dict(variant="preact", batch=8, seq=4096, oom=True),  # an out-of-memory probe: no row
            dict(variant="preact", largest_batch=8, peak_gib_at_largest=70.0)]  # a largest-batch summary: no row
    lines = scaling_report.titan_table(rows).splitlines()
    cells = {(c[1].strip(), c[2].strip()): c for c in (line.split("|") for line in lines[2:])}
    assert len(lines) == 2 + 6
    assert cells[("preact", "FSDP2 4")][7].strip() == "0.92"  # 220k / 4 over 60k
    assert cells[("preact", "FSDP2 4")][8].strip() == "1.25x"  # over torchtitan's FSDP2 at 4
    assert cells[("preact+exact", "EP 4")][7].strip() == "0.85"  # against preact on one GPU
    assert cells[("preact+exact", "EP 4")][8].strip() == "1.38x"  # over torchtitan's EP 4
    assert cells[("default", "1 GPU")][7].strip() == "1.00"
    assert cells[("default", "1 GPU")][10].strip() == "-"  # a row without a profiled step: no split


def test_titan_rows_kept_gathered_are_their_own_line_against_torchtitans_kept_gathered():
    rows = [_titan("default", 1, 50_000), _titan("preact", 1, 60_000),
            _titan("default", 4, 176_000), _titan("preact", 4, 220_000),
            {**_titan("default", 4, 180_000), "keep_gathered": True},
            {**_titan("preact", 4, 234_000), "keep_gathered": True}]
    lines = scaling_report.titan_table(rows).splitlines()
    cells = {(c[1].strip(), c[2].strip()): c for c in (line.split("|") for line in lines[2:])}
    assert len(lines) == 2 + 6
    assert cells[("preact", "FSDP2 4, kept gathered")][7].strip() == "0.97"  # 234k / 4 over 60k
    assert cells[("preact", "FSDP2 4, kept gathered")][8].strip() == "1.30x"  # over torchtitan's, also kept gathered
    assert cells[("preact", "FSDP2 4")][8].strip() == "1.25x"


def test_titan_rows_with_other_fsdp_options_are_their_own_lines():
    rows = [_titan("default", 1, 50_000), _titan("preact", 1, 60_000),
            {**_titan("default", 4, 190_000), "reduce_dtype": "bfloat16"},
            {**_titan("preact", 4, 228_000), "reduce_dtype": "bfloat16", "keep_gathered": True},
            {**_titan("preact", 4, 220_000), "reduce_dtype": "float32"},
            {**_titan("preact", 4, 229_000), "reduce_dtype": "bfloat16", "fsdp_prefetch": 2}]
    lines = scaling_report.titan_table(rows).splitlines()
    modes = {c[2].strip() for c in (line.split("|") for line in lines[2:])}
    assert modes == {"1 GPU", "FSDP2 4", "FSDP2 4, bf16 reductions", "FSDP2 4, kept gathered, bf16 reductions",
                     "FSDP2 4, bf16 reductions, prefetch 2"}


def test_titan_rows_show_their_communication_split_and_draw_a_plot(tmp_path, capsys):
    split = dict(gemm_ms=120.04, all_to_all_ms=30.0, allgather_reducescatter_ms=12.5, exposed_comm_ms=9.25)
    rows = [_titan("default", 1, 50_000), _titan("preact", 1, 60_000), {**_titan("preact+exact", 4, 204_000, ep=4),
                                                                        **split}]
    lines = scaling_report.titan_table(rows).splitlines()
    cells = {(c[1].strip(), c[2].strip()): c for c in (line.split("|") for line in lines[2:])}
    assert cells[("preact+exact", "EP 4")][10].strip() == "120.0 / 30.0 / 12.5 / 9.2"
    path, png = tmp_path / "titan.jsonl", tmp_path / "titan.png"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert scaling_report.main(["--titan", str(path), "--png", str(png)]) == 0
    assert "preact+exact" in capsys.readouterr().out
    assert png.stat().st_size > 0
