"""On a CUDA GPU (`pytest -m gpu`): the compiled Triton kernels at the benchmark configs in bf16, on each
backend: "tl" (the portable kernels, the path on every GPU but Hopper) and "gluon" (Hopper only). Each test
reads experts.dispatch's launch counts to check which kernels actually ran.

Tolerance: the error of PyTorch's own bf16 computation (the reference run in bf16) against the fp32
reference, times a small factor: our kernels round H, A, Y and dH to bf16 like any bf16 pipeline."""
import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze import MoELayer
from moeblaze.bench.harness import make_problem, reference_grads
from moeblaze.bench.names import CONFIGS
from moeblaze.experts import launch_counts, moe_experts
from moeblaze.reference import moe_experts_reference
from moeblaze.routing import build_routing_index
from moeblaze.routing.index import build_index_sort

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FACTOR = 2.0
NAMES = ("out", "dx", "dw1", "dw2", "dtopk_w")
GEMM_STAGES = {"up", "down", "down_bwd", "weight_grad", "dx_rows"}
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
BACKENDS = ["tl", pytest.param("gluon", marks=pytest.mark.skipif(not HOPPER, reason="needs sm_90"))]


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _run(p, fn):
    x, idx, w, dy = p.sets[0]
    out = fn(x, idx, w, p.w1, p.w2)
    return (out,) + torch.autograd.grad(out, (x, p.w1, p.w2, w), dy)


def _ours(p, checkpoint, backend):
    return lambda x, idx, w, w1, w2: moe_experts(x, build_routing_index(idx, p.E), w, w1, w2,
                                                 experts=ExpertsConfig(activation=p.activation, checkpoint=checkpoint,
                                                                      backend=backend))


def ran_on(stages=GEMM_STAGES) -> set:
    """The backends the given stages launched on since launch_counts was last cleared."""
    return {backend for (stage, backend) in launch_counts if stage in stages}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_configs_bf16_against_fp32_reference(name, backend):
    p = make_problem(*CONFIGS[name], dtype=torch.bfloat16, device="cuda")
    ref = reference_grads(p)
    torch_bf16 = _run(p, lambda x, idx, w, w1, w2: moe_experts_reference(x, idx, w, w1, w2,
                                                                         experts=ExpertsConfig(activation=p.activation)))
    bound = {n: FACTOR * _rel(a, r) + 1e-4 for n, a, r in zip(NAMES, torch_bf16, ref)}
    del torch_bf16
    for checkpoint in ("preact", "recompute"):
        launch_counts.clear()
        got = _run(p, _ours(p, checkpoint, backend))
        assert ran_on() == {backend}, dict(launch_counts)  # every GEMM of A-E qualifies for the Gluon kernels
        for n, a, r in zip(NAMES, got, ref):
            assert torch.isfinite(a).all(), (checkpoint, n)
            assert _rel(a, r) <= bound[n], (checkpoint, n, _rel(a, r), bound[n])
        del got
    torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ["geglu", "silu", "gelu", "relu", "relu2"])
def test_other_activations_bf16(activation, backend):
    p = make_problem(4096, 512, 384, 16, 2, activation, dtype=torch.bfloat16, device="cuda")
    ref = reference_grads(p)
    torch_bf16 = _run(p, lambda x, idx, w, w1, w2: moe_experts_reference(x, idx, w, w1, w2,
                                                                         experts=ExpertsConfig(activation=activation)))
    launch_counts.clear()
    got = _run(p, _ours(p, "preact", backend))
    # the Gluon up-projection is SwiGLU only: the other activations' up runs on tl, the rest on the backend
    assert ran_on({"up"}) == {"tl"} and ran_on(GEMM_STAGES - {"up"}) == {backend}, dict(launch_counts)
    for n, a, t, r in zip(NAMES, got, torch_bf16, ref):
        assert _rel(a, r) <= FACTOR * _rel(t, r) + 1e-4, (n, _rel(a, r), _rel(t, r))


def test_gluon_falls_back_to_tl_for_shapes_it_cannot_take():
    """d = 200 is no multiple of the gathering kernels' 64-column stage: on the Gluon backend the gathering
    launches (up, down_bwd) fall back to tl and still match; the row GEMMs (multiples of 8) stay on Gluon."""
    if not HOPPER:
        pytest.skip("needs sm_90")
    p = make_problem(2048, 200, 256, 8, 2, dtype=torch.bfloat16, device="cuda")
    ref = reference_grads(p)
    torch_bf16 = _run(p, lambda x, idx, w, w1, w2: moe_experts_reference(x, idx, w, w1, w2,
                                                                         experts=ExpertsConfig(activation=p.activation)))
    launch_counts.clear()
    got = _run(p, _ours(p, "preact", "gluon"))
    assert ran_on({"up", "down_bwd"}) == {"tl"} and ran_on({"down", "dx_rows"}) == {"gluon"}, dict(launch_counts)
    for n, a, t, r in zip(NAMES, got, torch_bf16, ref):
        assert _rel(a, r) <= FACTOR * _rel(t, r) + 1e-4, (n, _rel(a, r), _rel(t, r))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_deterministic(backend):
    p = make_problem(*CONFIGS["C"], dtype=torch.bfloat16, device="cuda")
    a, b = _run(p, _ours(p, "preact", backend)), _run(p, _ours(p, "preact", backend))
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_dense_index_equals_sort_on_gpu():
    for L, E, K in ((32768, 8, 2), (100_003, 64, 8), (5000, 256, 4)):
        idx = torch.randn(L, E, device="cuda").topk(K, dim=-1).indices.int()
        a, b = build_routing_index(idx, E, "dense"), build_index_sort(idx, E)
        assert all(torch.equal(u, v) for u, v in zip(a.tensors(), b.tensors()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph_matches_eager(backend):
    layer = MoELayer(512, 256, 16, 2, experts=ExpertsConfig(backend=backend)).cuda().to(torch.bfloat16)
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager = layer(x)
    launch_counts.clear()
    compiled = torch.compile(layer, fullgraph=True)(x)
    assert ran_on() == {backend}, dict(launch_counts)
    # Inductor fuses the fp32 router differently (last-bit differences in its weights), so the match is
    # to bf16 rounding, not bitwise; the expert kernels themselves are the same launches.
    assert _rel(compiled.out, eager.out) < 1e-2  # a few bf16 steps (2^-8 = 4e-3) where a routing weight's bits moved
    g1 = torch.autograd.grad(eager.out.float().sum(), (x, layer.w1))
    g2 = torch.autograd.grad(compiled.out.float().sum(), (x, layer.w1))
    assert all(_rel(u, v) < 1e-2 for u, v in zip(g1, g2))  # the same bf16 steps, carried back


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_step_never_syncs_with_host(backend):
    layer = MoELayer(512, 256, 16, 2, experts=ExpertsConfig(backend=backend)).cuda().to(torch.bfloat16)
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).out.float().sum().backward()  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, aux, z = layer(x)
        (out.float().sum() + aux + z).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_every_autotune_config_compiled():
    """Each config the tl autotuner may pick, forced alone (the rest at their tuned choice), gives the same
    answers within bf16 error on the tl backend (so the forced configs launch on Hopper too): the CPU tests run
    each code path under the interpreter, this runs the compiled variants. h = 384 leaves a partial column
    tile for the 256-wide configs."""
    from moeblaze.experts.tl import TUNED_KERNELS

    p = make_problem(4096, 512, 384, 16, 2, dtype=torch.bfloat16, device="cuda")
    ref = reference_grads(p)
    torch_bf16 = _run(p, lambda x, idx, w, w1, w2: moe_experts_reference(x, idx, w, w1, w2,
                                                                         experts=ExpertsConfig(activation=p.activation)))
    bound = {n: FACTOR * _rel(a, r) + 1e-4 for n, a, r in zip(NAMES, torch_bf16, ref)}
    for name, kernel in TUNED_KERNELS.items():
        configs = kernel.configs
        try:
            for cfg in configs:
                kernel.configs = [cfg]  # one config: the autotuner launches it without benchmarking
                for checkpoint in ("preact", "recompute"):
                    launch_counts.clear()
                    got = _run(p, _ours(p, checkpoint, "tl"))
                    assert ran_on() == {"tl"}, dict(launch_counts)
                    for n, a, r in zip(NAMES, got, ref):
                        assert _rel(a, r) <= bound[n], (name, str(cfg), checkpoint, n, _rel(a, r), bound[n])
        finally:
            kernel.configs = configs


def test_launch_cache_relaunches_what_triton_would():
    """moeblaze.launch: the first launch of a key goes through Triton and caches its kernel, the next ones
    launch it directly; every result matches torch, and a misaligned view takes a key (and kernel) of its own."""
    from moeblaze.experts import tl
    from moeblaze.launch import cached_kernels

    L, K, D = 300, 4, 200
    slot = torch.randperm(L * K, device="cuda").to(torch.int32).reshape(L, K)
    kept = torch.tensor([L * K], dtype=torch.int32, device="cuda")
    sizes = []
    for i in range(4):
        big = torch.randn(L * K * D + 1, device="cuda", dtype=torch.bfloat16)
        rows = (big[1:] if i == 3 else big[:-1]).view(L * K, D)  # i == 3: 2 bytes off 16-byte alignment
        w = torch.rand(L, K, device="cuda")
        out = tl.combine(rows, slot, w, kept, torch.bfloat16)
        want = (rows.float()[slot.long()] * w[..., None]).sum(1)
        # a bf16 output (half an ulp: 2^-9 = 2e-3 relative at most) of fp32 sums of 4: 4e-3 is two of it
        assert _rel(out, want) <= 4e-3, (i, _rel(out, want))
        sizes.append(cached_kernels())
    assert sizes[1] == sizes[2] == sizes[0] and sizes[3] == sizes[2] + 1, sizes


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_on_a_fresh_thread(backend):
    """Backward's launches encode TMA descriptors on the host, which needs a current CUDA context; autograd
    runs backward on a thread of its own, where none may be current yet (PyTorch issue 124565). Run the
    backward body on a new thread whose first CUDA work it is, and compare with the calling thread's."""
    import threading

    from moeblaze.experts.op import OpInputs, OpKey, experts_backward, experts_forward

    p = make_problem(1024, 256, 256, 8, 2, dtype=torch.bfloat16, device="cuda")
    x, idx, w, dy = p.sets[0]
    inputs = OpInputs.of(x.detach(), p.w1.detach(), p.w2.detach(), w.detach(), build_routing_index(idx, p.E))
    key = OpKey(backend=backend).text
    _, kept = experts_forward(inputs, key)
    bwd_args = (dy, inputs, kept, key)
    want = experts_backward(*bwd_args)
    got, errors = [], []

    def body():
        try:
            got.extend(experts_backward(*bwd_args))
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert not errors, errors
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("checkpoint", ["preact", "recompute"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend, checkpoint):
    """L = 0 (a rank without tokens): empty output, zero gradients, zero losses, no launch that can't take 0 rows."""
    layer = MoELayer(512, 256, 16, 2, experts=ExpertsConfig(checkpoint=checkpoint, backend=backend)).cuda().bfloat16()
    x = torch.randn(0, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, aux, z = layer(x)
    assert out.shape == (0, 512) and aux.item() == 0 and z.item() == 0
    (out.float().sum() + aux + z).backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)), name
    compiled = torch.compile(layer, fullgraph=True)(x)  # and under torch.compile (the fake kernels' shapes)
    assert compiled.out.shape == (0, 512)


_BAD_ID = """
import sys, torch
from moeblaze import build_routing_index, moe_experts
E, backend = 16, sys.argv[1]
x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
w1 = torch.randn(E, 512, 512, device="cuda", dtype=torch.bfloat16) / 23
w2 = torch.randn(E, 512, 256, device="cuda", dtype=torch.bfloat16) / 16
idx = torch.randn(256, E, device="cuda").topk(2, dim=-1).indices.int()
w = torch.rand(256, 2, device="cuda")
moe_experts(x, build_routing_index(idx, E), w, w1, w2, backend=backend)
torch.cuda.synchronize()
print("valid ids ran", flush=True)
idx[100, 1] = E  # one expert id out of range, found on the device: no host sync
y = moe_experts(x, build_routing_index(idx, E), w, w1, w2, backend=backend)
torch.cuda.synchronize()
print("bad id NOT caught", flush=True)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_out_of_range_expert_id_stops_the_program_on_the_device(backend):
    """A device-side assert poisons the CUDA context, so the case runs in a process of its own."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _BAD_ID, backend], capture_output=True, text=True, timeout=600)
    assert "valid ids ran" in r.stdout, r.stderr[-3000:]
    assert r.returncode != 0 and "bad id NOT caught" not in r.stdout
    assert "device-side assert" in r.stderr or "Assertion" in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("checkpoint", ["preact", "recompute"])
def test_w1_in_two_parts_equals_w1_whole(backend, checkpoint):
    """W1 as torchtitan's w1 and w3: output and every gradient bitwise those of W1 given whole, each part getting its
    rows of dW1. On Gluon every GEMM reads or writes the parts in place (each stage still launches on Gluon)."""
    L, D, H, E, K = 1000, 256, 384, 8, 2
    g = torch.Generator(device="cpu").manual_seed(5)
    x = torch.randn(L, D, generator=g).to("cuda", torch.bfloat16)
    w1 = (torch.randn(E, 2 * H, D, generator=g) * D ** -0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(E, D, H, generator=g) * H ** -0.5).to("cuda", torch.bfloat16)
    idx = torch.rand(L, E, generator=g).topk(K, dim=1).indices.int().cuda()  # K distinct experts a token
    w = torch.rand(L, K, generator=g).cuda()
    dy = torch.randn(L, D, generator=g).to("cuda", torch.bfloat16)
    config = ExpertsConfig(checkpoint=checkpoint, backend=backend)

    def run(parts: bool):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w1[:, :H], w1[:, H:], w2, w)]
        xl, gate, up, w2l, wl = leaves
        launch_counts.clear()
        out = moe_experts(xl, build_routing_index(idx, E), wl, (gate, up) if parts else torch.cat((gate, up), 1),
                          w2l, experts=config)
        grads = torch.autograd.grad(out, leaves, dy)
        assert ran_on() == {backend}, dict(launch_counts)
        return out, *grads

    for name, a, b in zip(("out", "dx", "dgate", "dup", "dw2", "dtopk_w"), run(True), run(False)):
        assert torch.equal(a, b), name
