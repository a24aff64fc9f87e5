"""The profile summaries against hand-computed cases: (name, start µs, duration µs) kernels laid out by hand."""
import pytest

from moeblaze.bench.harness import kernel_summary
from moeblaze.bench.timeline import idle_gaps, step_split

# two steps; in each, an up GEMM, a small index kernel overlapping it, a wait, then a down GEMM
KERNELS = [
    ("up_swiglu_kernel", 0.0, 100.0), ("build_index", 90.0, 20.0), ("_down_rows_kernel", 150.0, 50.0),
    ("up_swiglu_kernel", 300.0, 100.0), ("build_index", 390.0, 20.0), ("_down_rows_kernel", 450.0, 50.0),
]


def test_kernel_summary_spans_unions_and_gaps():
    s = kernel_summary(list(reversed(KERNELS)), steps=2)  # order given does not matter
    assert s["span_ms"] == pytest.approx(500 / 1e3 / 2)
    assert s["busy_ms"] == pytest.approx((110 + 50) * 2 / 1e3 / 2)  # the overlap counts once
    assert s["kernels"] == [("up_swiglu_kernel", 1.0, 0.1), ("_down_rows_kernel", 1.0, 0.05),
                            ("build_index", 1.0, 0.02)]
    # gaps: 110..150 after build_index (it ends last), 200..300 between the steps, twice 40 and once 100
    assert s["gaps"] == [(pytest.approx(0.05), "_down_rows_kernel", "up_swiglu_kernel"),
                         (pytest.approx(0.04), "build_index", "_down_rows_kernel")]


def test_kernel_summary_of_nothing():
    assert kernel_summary([], steps=3) == dict(span_ms=0.0, busy_ms=0.0, kernels=[], gaps=[])


def test_step_split_parts_and_exposed_communication():
    kernels = [("up_swiglu_kernel", 0.0, 100.0), ("ncclDevKernel_AllGather_RING", 50.0, 100.0),
               ("elementwise_kernel", 200.0, 10.0)]
    s = step_split(kernels)
    assert s["gemm_ms"] == pytest.approx(0.1)
    assert s["allgather_reducescatter_ms"] == pytest.approx(0.1)
    assert s["other_compute_ms"] == pytest.approx(0.01)
    assert s["all_to_all_ms"] == 0.0
    assert s["busy_ms"] == pytest.approx(0.16)
    assert s["exposed_comm_ms"] == pytest.approx(0.05)  # 100..150 has no compute under it
    assert s["exposed_allgather_ms"] == pytest.approx(0.05)
    assert s["exposed_reducescatter_ms"] == s["exposed_allreduce_ms"] == s["exposed_all_to_all_ms"] == 0.0


def test_step_split_says_which_collective_is_exposed():
    # a reduce-scatter wholly under a GEMM, an all-to-all half under it, an all-reduce alone after it, and an
    # all-gather alongside that all-reduce: each collective's own exposed time, the overlap of two counted in each
    kernels = [("weight_grad_kernel", 0.0, 100.0), ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 10.0, 50.0),
               ("ncclDevKernel_SendRecv", 80.0, 40.0), ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 130.0, 30.0),
               ("ncclDevKernel_AllGather_RING_LL", 150.0, 20.0)]
    s = step_split(kernels)
    assert s["exposed_reducescatter_ms"] == 0.0
    assert s["exposed_all_to_all_ms"] == pytest.approx(0.02)
    assert s["exposed_allreduce_ms"] == pytest.approx(0.03)
    assert s["exposed_allgather_ms"] == pytest.approx(0.02)
    assert s["exposed_comm_ms"] == pytest.approx(0.02 + 0.04)  # 100..120 and 130..170


def _x(cat, name, ts, dur, tid=1, **args):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=tid, args=args)


def test_idle_gaps_say_whether_the_gpu_waited_for_the_host_or_for_a_dependency():
    events = [
        # host: a step op; inside it a launch, a synchronization, then two launches under an FSDP2 hook
        _x("cpu_op", "step", 0, 2000), _x("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 20, 5, correlation=2),
        _x("cuda_runtime", "cudaDeviceSynchronize", 30, 600),
        _x("cpu_op", "FSDP::pre_backward", 700, 300), _x("cpu_op", "aten::_chunk_cat", 710, 100),
        _x("cuda_runtime", "cudaLaunchKernel", 720, 5, correlation=3),
        _x("cuda_driver", "cuLaunchKernelEx", 730, 5, correlation=4),  # how Triton launches
        # GPU: 1 at 100-300; 2 (launched at 20) waits until 500; 3 (launched at 720) at 800-900; 4 right after
        _x("kernel", "gemm_a", 100, 200, tid=7, correlation=1), _x("kernel", "gemm_b", 500, 100, tid=8, correlation=2),
        _x("kernel", "chunk_cat", 800, 100, tid=7, correlation=3), _x("gpu_memcpy", "copy", 950, 50, tid=7,
                                                                       correlation=4),
    ]
    gaps = idle_gaps(events, min_us=40)
    assert [(round(g["ms"], 3), g["next"], g["cause"]) for g in gaps] == [
        (0.2, "gemm_b", "dependency"), (0.2, "chunk_cat", "host"), (0.05, "copy", "dependency")]
    host = gaps[1]
    assert host["host_op"] == "cudaDeviceSynchronize" and host["launched_in"] == [
        "step", "FSDP::pre_backward", "aten::_chunk_cat"]
    # a gap ended by the driver-launched copy: in the FSDP2 hook, not in the launch itself
    late = [e for e in events if e["cat"] != "cuda_driver"] + [
        _x("cuda_driver", "cuLaunchKernelEx", 905, 5, correlation=4)]
    copy = [g for g in idle_gaps(late, min_us=40) if g["next"] == "copy"][0]
    assert copy["cause"] == "host" and copy["launched_in"] == ["step", "FSDP::pre_backward"], copy
    # two activities with the same start and length (on two streams) are fine
    twin = events + [_x("kernel", "twin", 100, 200, tid=9, correlation=1)]
    assert [g["next"] for g in idle_gaps(twin, min_us=40)] == ["gemm_b", "chunk_cat", "copy"]
    assert idle_gaps(events, min_us=300) == [] and idle_gaps([], 0) == []
