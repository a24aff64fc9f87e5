"""benchmarks/stage_map.py's pure parts: a kernel gets the innermost stage range around its launch (by correlation
id, on the launching thread), a kernel launched outside every range is "other", and a stage's share of its limit
is its floor over its time."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import stage_map  # noqa: E402


def _trace(tmp_path):
    ev = [
        {"cat": "user_annotation", "name": "stage:up", "tid": 1, "ts": 0, "dur": 100},
        {"cat": "user_annotation", "name": "stage:quant", "tid": 1, "ts": 10, "dur": 20},  # inside up
        {"cat": "user_annotation", "name": "stage:dW1", "tid": 2, "ts": 0, "dur": 100},  # another thread
        {"cat": "cuda_driver", "name": "cuLaunchKernelEx", "tid": 1, "ts": 15, "dur": 1, "args": {"correlation": 7}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": 50, "dur": 1, "args": {"correlation": 8}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": 150, "dur": 1, "args": {"correlation": 9}},
        {"cat": "kernel", "name": "q", "ts": 300, "dur": 5, "args": {"correlation": 7}},
        {"cat": "kernel", "name": "g", "ts": 310, "dur": 50, "args": {"correlation": 8}},
        {"cat": "kernel", "name": "z", "ts": 400, "dur": 2, "args": {"correlation": 9}},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    return str(path)


def test_kernels_take_the_innermost_range_of_their_launch(tmp_path):
    assert stage_map.labelled_kernels(_trace(tmp_path)) == [("quant", "q", 300, 5), ("up", "g", 310, 50),
                                                           ("other", "z", 400, 2)]


def test_share_of_limit_is_floor_over_time():
    L, d, h, E, K = 1024, 512, 256, 8, 2
    flops = 4 * L * K * d * h
    row = dict(shape=[L, d, h, E, K], impl="moeblaze", roofs={"mma_tflops": 100.0, "hbm_gbs": 1000.0},
               kernels={"up": [["k", 2 * flops / 100e12 * 1e3]], "dx": [["c", 1.0]]})
    m = stage_map.stage_metrics(row)
    ms, tflops, _, share = m["up"]
    assert tflops == pytest.approx(50.0) and share == pytest.approx(0.5)
    nbytes = stage_map.stage_bytes("dx", L, d, h, E, K)
    assert m["dx"][3] == pytest.approx(nbytes / 1e12 / 1e-3)  # 1 ms against 1000 GB/s
    assert m["dx"][1] is None and "down" not in m


def test_an_fp8_step_the_rule_ran_in_bf16_is_held_to_the_bf16_rate():
    """precision="fp8" below fp8_min_rows runs native GEMMs (no quantizer in the step): its GEMMs' share is of the
    bf16 rate, not the e4m3 one; a step that quantized is held to the e4m3 rate."""
    L, d, h, E, K = 1024, 512, 256, 8, 2
    flops = 4 * L * K * d * h
    roofs = {"mma_tflops": 100.0, "fp8_mma_tflops": 200.0, "hbm_gbs": 1e9}  # bytes never the floor here
    up = [["k", flops / 100e12 * 1e3]]  # the bf16 rate's time
    native = dict(shape=[L, d, h, E, K], impl="moeblaze-fp8", roofs=roofs, kernels={"up": up})
    e4m3 = dict(native, kernels={"up": up, "quant": [["q", 0.01]]})
    assert stage_map.stage_metrics(native)["up"][3] == pytest.approx(1.0)
    assert stage_map.stage_metrics(e4m3)["up"][3] == pytest.approx(0.5)
