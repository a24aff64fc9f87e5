"""On a CUDA GPU with fp8 tensor cores (`pytest -m gpu`, sm_89 and later): the fp8 expert GEMMs (tl, and Gluon on
Hopper) on real e4m3 operands against reference.fp8's emulation, gathered and not, at an expert shape with ragged
tiles and an empty expert; the one-pass quantizers against reference.fp8 bit for bit; the preact-fp8 policy and
precision="fp8" in bf16 on both backends within FACTOR x the bf16 reference's error against fp32."""
import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze.experts import moe_experts
from moeblaze.reference import fake_quant_blocks, fake_quant_rows, moe_experts_reference, quantize_blocks, quantize_rows
from moeblaze.routing import build_routing_index, route_topk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FACTOR = 2.0


def _layer_problem(L=2048, D=512, H=256, E=16, K=2):
    """(x, w1, w2, topk ids, weights, dy) in fp32 on the GPU: a SwiGLU layer under a fresh router's routing."""
    torch.manual_seed(0)
    x = torch.randn(L, D, device="cuda")
    w1, w2 = torch.randn(E, 2 * H, D, device="cuda") / D ** 0.5, torch.randn(E, D, H, device="cuda") / H ** 0.5
    idx, w = route_topk(torch.randn(L, E, device="cuda"), K)
    return x, w1, w2, idx, w, torch.randn(L, D, device="cuda")


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _skip_unless(backend):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs fp8 tensor cores (sm_89+)")
    if backend == "gluon" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Gluon kernels: Hopper only")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["tl", "gluon", "gluon-gather"])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("N", [1000, 640])
def test_fp8_rows_gemm_on_e4m3_matches_the_emulation(N, gather, backend, out_dtype):
    """gluon-gather: the Hopper kernel with A in place read by the gathering loader (tma_a=False) instead of TMA;
    gluon: bf16 C by two MMA warpgroups each on its own rows, fp32 C by one 8-warp partition.
    N: the last 256-column tile's second half partly past N (1000), or wholly (640: skipped)."""
    import functools

    from moeblaze.experts import gluon_sm90
    from moeblaze.experts.stages import RowPlan
    from moeblaze.experts.tl.fp8 import fp8_rows_gemm

    if backend == "gluon-gather" and gather:
        pytest.skip("gathered A is read by the gathering loader anyway")
    _skip_unless("gluon" if backend.startswith("gluon") else backend)
    gemm = {"tl": fp8_rows_gemm, "gluon": gluon_sm90.fp8_rows_gemm,
            "gluon-gather": functools.partial(gluon_sm90.fp8_rows_gemm, tma_a=False)}[backend]
    torch.manual_seed(0)
    L, K, E, Kd = 4096, 4, 16, 1536
    logits = torch.randn(L, E, device="cuda")
    logits[:, 3] = -1e4  # expert 3 gets no rows
    idx, _ = route_topk(logits, K)
    plan = RowPlan.build(build_routing_index(idx, E))
    R = L * K
    a = torch.randn(L if gather else R, Kd, device="cuda").bfloat16()
    b = torch.randn(E, N, Kd, device="cuda").bfloat16()
    (a_q, a_s), (b_q, b_s) = quantize_rows(a), quantize_blocks(b)
    out = gemm(a_q, a_s, b_q, b_s, R, plan.offsets_E1, plan.sched, token=plan.token_R if gather else None,
               out_dtype=out_dtype)
    again = gemm(a_q, a_s, b_q, b_s, R, plan.offsets_E1, plan.sched, token=plan.token_R if gather else None,
                 out_dtype=out_dtype)
    assert torch.equal(out, again)  # deterministic
    src = plan.token_R.long() if gather else torch.arange(R, device="cuda")
    aq, bq, off = fake_quant_rows(a), fake_quant_blocks(b), plan.offsets_E1.tolist()
    want = torch.cat([aq[src[off[e]:off[e + 1]]] @ bq[e].t() for e in range(E)])
    # Hopper's fp8 MMA accumulates a 128-deep block in fewer bits than fp32 (about 14, DeepSeek-V3 §3.3.2; the
    # reason for the promotion every 128): ~1e-4 from the emulation's fp32 sums, measured; bf16 output adds its
    # rounding. Against the exact product of the bf16 inputs, the kernel stays within 1.1x the emulation's error.
    assert torch.isfinite(out).all() and _rel(out, want) <= (1e-3 if out_dtype == torch.float32 else 4e-3)
    exact = torch.cat([a.float()[src[off[e]:off[e + 1]]] @ b.float()[e].t() for e in range(E)])
    assert _rel(out, exact) <= 1.1 * _rel(want, exact), (_rel(out, exact), _rel(want, exact))


def test_one_pass_quantizers_on_the_gpu_are_the_references():
    from moeblaze.experts import quant
    from moeblaze.reference import apply_activation

    torch.manual_seed(0)
    t = torch.randn(3000, 1000, device="cuda").bfloat16() * torch.logspace(-3, 3, 3000, device="cuda")[:, None]
    t[5] = 0
    w = t.view(3, 1000, 1000)
    both, both_t = quant.quantize_blocks(w, both=True)
    h = torch.cat([t, t[:, :24]], 1)  # (3000, 1024): H with h = 512, whose groups fall on gate's and up's
    pairs = [(quant.quantize_rows(t), quantize_rows(t)), (quant.quantize_blocks(w), quantize_blocks(w)),
             (quant.quantize_blocks(w, transpose=True), quantize_blocks(w.transpose(1, 2).contiguous())),
             (both, quantize_blocks(w)), (both_t, quantize_blocks(w.transpose(1, 2).contiguous()))]
    for interleaved in (False, True):  # H's own pair, from the SwiGLU quantizer's read of H
        pairs.append((quant.swiglu_quantize(h, interleaved, keep_preact=True)[1], quantize_rows(h)))
    for got, want in pairs:
        assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    # SwiGLU: the kernel's exp differs from torch's in its last bits, so A in bf16 may differ by one bf16 step
    # (2^-8 relative), and with it a group's amax (its scale) and a value's e4m3 neighbour, rarely
    got, want = quant.swiglu_quantize(t), quantize_rows(apply_activation(t, "swiglu"))
    assert ((got[1] - want[1]).abs() <= want[1] * 2 ** -7).all()
    # a value moved one bf16 step lands on another e4m3 value at odds ~2^-8 / 2^-4 where its group's scale held:
    # rarer still, as the step must straddle a rounding midpoint; 1e-3 of the values
    assert (got[0].float() != want[0].float()).float().mean() <= 1e-3


@pytest.mark.parametrize("backend", ["tl", "gluon"])
def test_preact_fp8_bf16(backend):
    if backend == "gluon" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Gluon kernels: Hopper only")
    x, w1, w2, idx, w, dy = _layer_problem()
    E = w1.shape[0]

    def run(dtype, **kw):
        ins = [t.to(dtype).requires_grad_() for t in (x, w1, w2, w)]
        if kw.pop("kernels", False):
            out = moe_experts(ins[0], build_routing_index(idx, E), ins[3], ins[1], ins[2], experts=ExpertsConfig(**kw))
        else:
            out = moe_experts_reference(ins[0], idx, ins[3], ins[1], ins[2], experts=ExpertsConfig(**kw))
        return [out, *torch.autograd.grad(out, ins, dy.to(dtype))]

    want = run(torch.float32, checkpoint="preact-fp8")
    ref = run(torch.bfloat16, checkpoint="preact-fp8")
    got = run(torch.bfloat16, kernels=True, checkpoint="preact-fp8", backend=backend)
    for name, g, r, wt in zip(("out", "dx", "dw1", "dw2", "dw"), got, ref, want):
        assert torch.isfinite(g).all(), name
        assert _rel(g, wt) <= FACTOR * max(_rel(r, wt), 1e-3), (name, _rel(g, wt), _rel(r, wt))


@pytest.mark.parametrize("masters", [False, True], ids=["bf16-weights", "fp32-masters"])
@pytest.mark.parametrize("backend", ["tl", "gluon"])
@pytest.mark.parametrize("checkpoint", ["preact", "preact-fp8", "recompute"])
def test_precision_fp8_bf16_against_the_emulation(checkpoint, backend, masters):
    """precision="fp8" on real e4m3 in bf16: output and every gradient within FACTOR x the bf16 emulation's error
    against the fp32 emulation (the same recipe), and within the recipe's own error of the exact fp32 layer.
    masters: the weights float32 (bf16 x), quantized where they lie, their gradients stored in float32 by the
    weight-gradient kernels."""
    from moeblaze.experts import dispatch

    _skip_unless(backend)
    if masters and checkpoint == "preact-fp8":
        pytest.skip("the masters' path is the same under every checkpoint policy; two of them suffice")
    x, w1, w2, idx, w, dy = _layer_problem()
    routing = build_routing_index(idx, w1.shape[0])

    def run(dtype, **kw):
        wdt = torch.float32 if masters else dtype
        ins = [t.to(d).requires_grad_() for t, d in ((x, dtype), (w1, wdt), (w2, wdt), (w, dtype))]
        out = moe_experts(ins[0], routing, ins[3], ins[1], ins[2], experts=ExpertsConfig(checkpoint=checkpoint, **kw))
        return [out, *torch.autograd.grad(out, ins, dy.to(dtype))]

    want = run(torch.float32, backend="reference", precision="fp8", fp8_min_rows=0)
    ref = run(torch.bfloat16, backend="reference", precision="fp8", fp8_min_rows=0)
    exact = run(torch.float32, backend="reference")
    dispatch.launch_counts.clear()
    got = run(torch.bfloat16, precision="fp8", fp8_min_rows=0, backend=backend)
    assert dispatch.launch_counts["fp8_rows", backend] >= 4, dispatch.launch_counts
    assert dispatch.launch_counts["weight_grad", backend] >= 2, dispatch.launch_counts
    if masters:
        assert got[2].dtype == got[3].dtype == torch.float32
    for name, g, r, wt, ex in zip(("out", "dx", "dw1", "dw2", "dw"), got, ref, want, exact):
        assert torch.isfinite(g).all(), name
        assert _rel(g, wt) <= FACTOR * max(_rel(r, wt), 1e-3), (name, _rel(g, wt), _rel(r, wt))
        assert _rel(g, ex) <= 0.1, (name, _rel(g, ex))


@pytest.mark.parametrize("backend", ["tl", "gluon"])
def test_fp8_weight_cache_and_the_dh_pass_quantizer_on_the_gpu(backend):
    """precision="fp8" with fp8_weight_cache: the same output and gradients, bit for bit, as quantizing where used;
    the dH pass's q(dH) is quantize_rows(dH) bit for bit on the GPU."""
    from moeblaze.experts import stages
    from moeblaze.experts.stages import RowPlan
    from moeblaze.experts import quant

    _skip_unless(backend)
    x, w1, w2, idx, w, dy = _layer_problem()
    routing = build_routing_index(idx, w1.shape[0])
    w1, w2 = w1.bfloat16().requires_grad_(), w2.bfloat16().requires_grad_()

    def run(cache):
        ins = [t.bfloat16().requires_grad_() for t in (x, w)]
        cfg = ExpertsConfig(precision="fp8", fp8_min_rows=0, fp8_weight_cache=cache, backend=backend)
        out = moe_experts(ins[0], routing, ins[1], w1, w2, experts=cfg)
        return [out, *torch.autograd.grad(out, [*ins, w1, w2], dy.bfloat16())]

    plain = run(False)
    for _ in range(2):
        for a, b in zip(run(True), plain):
            assert torch.equal(a, b)
    plan = RowPlan.build(routing)
    R, F, H = idx.numel(), w1.shape[1], w1.shape[1] // 2
    preact = torch.randn(R, F, device="cuda").bfloat16()
    for interleaved in (False, True):
        dpreact, act_scaled = torch.empty_like(preact), torch.randn(R, H, device="cuda").bfloat16()
        q = (torch.empty(R, F, device="cuda", dtype=torch.float8_e4m3fn),
             torch.empty(R, F // 128, device="cuda"))
        stages.act_bwd(plan, act_scaled, preact, w, dpreact, act_scaled, "swiglu", interleaved=interleaved,
                       dpreact_q=q)
        want = quant.quantize_rows(dpreact)
        assert torch.equal(q[1], want[1]) and torch.equal(q[0].view(torch.uint8), want[0].view(torch.uint8))




@pytest.mark.parametrize("backend", ["tl", "gluon"])
@pytest.mark.parametrize("checkpoint", ["preact", "preact-fp8", "recompute"])
def test_fp8_nan_and_inf_reach_the_output_as_in_native_precision(backend, checkpoint):
    """bf16 on real e4m3: a NaN or Inf in x, or NaN in dy, makes the same rows of out and dx non-finite under
    precision="fp8" as under native precision (the quantizers' max once dropped NaN)."""
    _skip_unless(backend)
    x, w1, w2, idx, w, dy = (t.bfloat16() if t.is_floating_point() else t for t in _layer_problem())
    x[3, 5], x[900, 0], dy[1500, 2] = float("nan"), float("inf"), float("nan")
    routing = build_routing_index(idx, w1.shape[0])

    def bad_rows(config):
        xi = x.clone().requires_grad_()
        out = moe_experts(xi, routing, w, w1, w2, experts=config)
        out.backward(dy)
        return [(~torch.isfinite(t)).any(1).nonzero().flatten().tolist() for t in (out, xi.grad)]

    native = bad_rows(ExpertsConfig(backend=backend, checkpoint=checkpoint.replace("preact-fp8", "preact")))
    assert native[0] == [3, 900]
    assert bad_rows(ExpertsConfig(backend=backend, precision="fp8", fp8_min_rows=0, checkpoint=checkpoint)) == native
