"""e4m3 quantization (reference.fp8) on hand-made cases, and checkpoint="preact-fp8": the kernels (interpreter)
against the reference's arithmetic for it, against plain "preact", and its kept bytes."""
import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze.bench.memory import SavedTensorCounter
from moeblaze.experts import moe_experts
from moeblaze.reference import (FP8_MAX, dequantize_blocks, dequantize_rows, fake_quant_rows, moe_experts_reference,
                                quantize_blocks, quantize_rows)
from moeblaze.routing import build_routing_index

from helpers import FP8_VS_EMULATION, random_problem, rel_err


def test_rows_scale_each_group_of_128_to_448():
    t = torch.zeros(2, 300)
    t[0, :128] = torch.linspace(-3, 2, 128)  # amax 3
    t[0, 128:256] = 0.5  # amax 0.5
    t[0, 256:] = torch.tensor([7.0] + [1.0] * 43)  # a last group of 44, amax 7
    q, s = quantize_rows(t)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (2, 300) and s.shape == (2, 3)
    assert torch.allclose(s[0], torch.tensor([3.0, 0.5, 7.0]) / FP8_MAX)
    assert q[0, 0].float() == -FP8_MAX and q[0, 256].float() == FP8_MAX  # each group's amax maps to ±448
    assert (s[1] > 0).all() and (q[1].float() == 0).all()  # an all-zero row: positive scales, zeros, no NaN
    d = dequantize_rows(q, s)
    assert torch.isfinite(d).all() and torch.equal(d[1], t[1])
    assert (d[0] - t[0]).abs().max() <= 3.0 * 2 ** -4  # e4m3: 3 mantissa bits, half an ulp of the group's top


def test_an_outlier_costs_only_its_own_group():
    """An outlier column: every other group's values are quantized exactly as without it; its own group keeps its
    relative precision at 100x (e4m3 has 4 exponent bits: the others stay normal numbers) and loses its small values
    only at 1e6x, where they fall below e4m3's smallest subnormal."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 512, generator=g)
    clean = (fake_quant_rows(t) - t).norm(dim=0)
    for factor, worse in ((100.0, False), (1e6, True)):
        u = t.clone()
        u[:, 5] *= factor
        noisy = (fake_quant_rows(u) - u).norm(dim=0)
        assert torch.equal(noisy[128:], clean[128:])
        others = torch.cat([noisy[:5], noisy[6:128]]).sum() / torch.cat([clean[:5], clean[6:128]]).sum()
        assert (others > 10) if worse else (others < 2), (factor, float(others))


def test_blocks_scale_each_128_by_128_block():
    w = torch.ones(3, 200, 130)
    w[1, 150, 129] = -9.0  # in block (1, 1) of matrix 1
    q, s = quantize_blocks(w)
    assert q.shape == w.shape and s.shape == (3, 2, 2)
    want = torch.ones(3, 2, 2)
    want[1, 1, 1] = 9.0
    assert torch.allclose(s, want / FP8_MAX)
    d = dequantize_blocks(q, s)
    # the scale is amax times fp32's 1/448 (one rounding, alike on every device): within an ulp of amax / 448
    assert torch.allclose(d[1, 150, 129], torch.tensor(-9.0), rtol=2 ** -23, atol=0)
    assert torch.allclose(d[0], w[0], rtol=2 ** -23, atol=0)
    assert torch.equal(quantize_blocks(torch.zeros(1, 128, 128))[0].float(), torch.zeros(1, 128, 128))


def test_values_past_448_saturate():
    q, s = quantize_rows(torch.tensor([[1e30, -1e30, 1.0]]))
    assert torch.isfinite(dequantize_rows(q, s)).all() and q.float().abs().max() == FP8_MAX


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_preact_fp8_kernels_match_the_reference(poison_alloc, activation):
    """The kernels under "preact-fp8" against the reference's arithmetic for it (the same quantization of the same
    pre-activation), fp32 inputs, fp64 reference: the output and every gradient; the output equals plain "preact"'s
    and the gradients stay within the format's error of it; a ragged F (not a multiple of 128) included."""
    torch.manual_seed(0)
    x, w1, w2, idx, w = random_problem(40, 32, 100 if activation == "gelu" else 72, 6, 2, activation)
    routing = build_routing_index(idx, 6)
    dy = torch.randn_like(x)

    def run(impl, checkpoint, dtype):
        ins = [t.to(dtype).requires_grad_() for t in (x, w1, w2, w)]
        cfg = ExpertsConfig(activation=activation, checkpoint=checkpoint, backend=impl)
        if impl == "reference":
            out = moe_experts_reference(ins[0], idx, ins[3], ins[1], ins[2], experts=cfg)
        else:
            out = moe_experts(ins[0], routing, ins[3], ins[1], ins[2], experts=cfg)
        return [out, *torch.autograd.grad(out, ins, dy.to(dtype))]

    got = run("triton", "preact-fp8", torch.float32)
    want = run("reference", "preact-fp8", torch.float64)
    exact = run("reference", "preact", torch.float64)
    plain = run("triton", "preact", torch.float32)
    assert torch.equal(got[0], plain[0])
    for name, g, r, e in zip(("out", "dx", "dw1", "dw2", "dw"), got, want, exact):
        # fp32 kernels against fp64 with the same e4m3 H: the fp32 sums' error (~D · 2^-24 worst, 1e-6 here) and
        # H's dequantisation (exact in fp32): 1e-5 is 10x that, one wrong e4m3 value of H errs by ~1e-3
        assert rel_err(g, r) <= 1e-5, (name, rel_err(g, r))
        assert rel_err(g, e) <= 0.05, (name, rel_err(g, e))  # e4m3's error on H, nothing worse
    assert rel_err(got[1], exact[1]) > 1e-4  # the gradients do see the fp8 pre-activation


@pytest.mark.parametrize("activation,interleaved,H", [("swiglu", False, 136), ("swiglu", False, 256),
                                                      ("swiglu", True, 136), ("gelu", False, 200)])
def test_dh_pass_reads_e4m3_preact_as_its_read_back_copy(poison_alloc, activation, interleaved, H):
    """The dH pass (act_bwd) given H in e4m3 and its scales equals the same pass over the one-pass read-back copy
    (quant.dequantize_rows) bit for bit: dH, s·A and dS; H wider than one 128-column group, and ragged; scales
    loaded per group (interleaved, plain, gate-first with H a multiple of 128) and per element (gate-first 136)."""
    from moeblaze.experts import stages
    from moeblaze.experts.stages import RowPlan
    from moeblaze.experts import quant

    torch.manual_seed(1)
    x, w1, w2, idx, w = random_problem(24, 16, H, 4, 2, activation)
    plan = RowPlan.build(build_routing_index(idx, 4))
    R, F = idx.numel(), w1.shape[1]
    preact = torch.randn(R, F) * torch.logspace(-2, 2, F)[None, :]
    kept, scale = quant.quantize_rows(preact)
    # the scales in a wider buffer of NaN: a scale read past a row's groups (for a column past H) shows
    padded = torch.full((R, scale.shape[1] + 1), float("nan"))
    padded[:, :-1] = scale
    scale = padded[:, :-1]
    dact = torch.randn(R, H)

    def run(h, **kw):
        dpreact, act_scaled = torch.empty(R, F), torch.empty(R, H)
        ds = stages.act_bwd(plan, dact, h, w, dpreact, act_scaled, activation, interleaved=interleaved, **kw)
        return dpreact, act_scaled, ds

    for got, want in zip(run(kept, preact_scale=scale), run(quant.dequantize_rows(kept, scale, torch.float32))):
        assert torch.equal(got, want)


@pytest.mark.parametrize("activation,interleaved,H,fp8_h", [("swiglu", False, 256, False), ("swiglu", True, 136, True),
                                                           ("swiglu", True, 40, False), ("gelu", False, 200, True)])
def test_dh_pass_quantizes_dh_as_quantize_rows(poison_alloc, activation, interleaved, H, fp8_h):
    """With dpreact_q, the dH pass also writes quant.quantize_rows(dH) of the dH it stores, bit for bit, and stores
    the same dH, s·A and dS as without it; gate-first dH (H a multiple of 128: its up groups start at H),
    interleaved (groups of 64 pairs; ragged, and a last group past the end), non-gated; H in e4m3 or not. Where
    gate-first H is not a multiple of 128 it refuses."""
    from moeblaze.experts import stages
    from moeblaze.experts.stages import RowPlan
    from moeblaze.experts import quant
    from moeblaze.experts.tl import dh_quantizable

    torch.manual_seed(H)
    x, w1, w2, idx, w = random_problem(24, 16, H, 4, 2, activation)
    plan = RowPlan.build(build_routing_index(idx, 4))
    R, F = idx.numel(), w1.shape[1]
    preact = torch.randn(R, F) * torch.logspace(-2, 2, F)[None, :]
    dact = torch.randn(R, H) * torch.logspace(-3, 3, R)[:, None]
    dact[3] = 0  # a zero row of dH: its scales are the floor
    h, kw = preact, {}
    if fp8_h:
        h, scale = quant.quantize_rows(preact)
        kw = dict(preact_scale=scale)

    def run(q=None):
        dpreact, act_scaled = torch.empty(R, F), torch.empty(R, H)
        ds = stages.act_bwd(plan, dact, h, w, dpreact, act_scaled, activation, interleaved=interleaved,
                            dpreact_q=q, **kw)
        return dpreact, act_scaled, ds

    assert dh_quantizable(H, activation, interleaved)
    q = (torch.empty(R, F, dtype=torch.float8_e4m3fn), torch.full((R, -(-F // 128)), float("nan")))
    got, plain = run(q), run()
    for a, b in zip(got, plain):
        assert torch.equal(a, b)
    want_q, want_s = quantize_rows(got[0])
    assert torch.equal(q[1], want_s)
    assert torch.equal(q[0].float(), want_q.float())
    if activation == "swiglu" and not interleaved:
        assert not dh_quantizable(200, activation, False)
        with pytest.raises(ValueError, match="not quantized in the pass"):
            stages.act_bwd(plan, torch.randn(R, 200), torch.randn(R, 400), w, torch.empty(R, 400),
                           torch.empty(R, 200), activation, dpreact_q=q)


def test_dh_pass_finds_each_row_s_pair_in_a_wide_table(poison_alloc):
    """A token-rounded routing's table wider than 8 places (read one row of places at a time) gives the dH pass
    the same dH, s·A and per-pair dS as the same pairs in a table of 8 places (read place by place)."""
    from moeblaze.experts import stages
    from moeblaze.experts.stages import RowPlan
    from moeblaze.routing.rounding import rounded_index

    torch.manual_seed(2)
    L, E, F, H = 40, 12, 64, 32
    kept = torch.rand(L, E) < 0.4
    kept[kept.sum(1) > 8] = False  # at most 8 experts a token, so both widths hold every pair
    weights = torch.rand(L, E)
    R = int(kept.sum())
    preact, dact = torch.randn(R + 1, F), torch.randn(R + 1, H)
    got = {}
    for width in (8, 16):
        index, w, overflow = rounded_index(kept, weights, width, R)
        assert not overflow
        plan = RowPlan.build(index)
        dpreact, act_scaled = torch.empty(R + 1, F), torch.empty(R + 1, H)
        ds = stages.act_bwd(plan, dact, preact, w, dpreact, act_scaled, "swiglu")
        used = index.token_slot < R
        got[width] = (dpreact[:R], act_scaled[:R], ds[used], index.token_slot[used])
    for a, b in zip(got[8], got[16]):
        assert torch.equal(a, b)


def test_preact_fp8_keeps_one_byte_per_element_and_a_scale_per_128():
    x, w1, w2, idx, w = random_problem(64, 32, 96, 4, 2)  # F = 192: two groups per row, the last one 64 wide
    routing = build_routing_index(idx, 4)
    kept = {}
    for checkpoint in ("preact", "preact-fp8"):
        ins = [t.clone().requires_grad_() for t in (x, w1, w2, w)]
        with SavedTensorCounter(exclude=ins) as c:
            moe_experts(ins[0], routing, ins[3], ins[1], ins[2], experts=ExpertsConfig(checkpoint=checkpoint,
                                                                                      backend="triton"))
        kept[checkpoint] = c.total_bytes
    R, F = 64 * 2, 192
    assert kept["preact"] - kept["preact-fp8"] == R * F * (4 - 1) - R * 2 * 4


@pytest.mark.parametrize("checkpoint,precision", [("preact-fp8", "native"), ("preact", "fp8"),
                                                  ("preact-fp8", "fp8"), ("recompute", "fp8")])
def test_preact_fp8_under_compile_equals_eager(checkpoint, precision):
    """torch.compile(fullgraph=True) traces the custom ops with the e4m3 pre-activation and its scales (their fake
    shapes and dtypes), and precision="fp8"'s ops: the same output and gradients as eager."""
    x, w1, w2, idx, w = random_problem(24, 128, 64, 4, 2)
    routing = build_routing_index(idx, 4)

    def step(fn):
        ins = [t.clone().requires_grad_() for t in (x, w1, w2, w)]
        out = fn(ins[0], routing.expert_counts, routing.expert_offsets, routing.expert_token_idx,
                 routing.token_slot, ins[3], ins[1], ins[2])
        return [out, *torch.autograd.grad(out.square().sum(), ins)]

    def layer(x, counts, offsets, eti, slot, w, w1, w2):
        from moeblaze.routing import RoutingIndex
        return moe_experts(x, RoutingIndex(counts, offsets, eti, slot), w, w1, w2,
                           experts=ExpertsConfig(checkpoint=checkpoint, precision=precision,
                                                backend="triton"), check=False)

    eager = step(layer)
    compiled = step(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("activation,biases", [("swiglu", False), ("gelu", True), ("swiglu", True)])
@pytest.mark.parametrize("preact_fp8", [False, True])
def test_fp8_gemm_emulation_backward_is_autograd_without_quantization(monkeypatch, activation, biases, preact_fp8):
    """The fp8 emulation's hand-written backward (dA' = dy W2, dS = <dA', A> + <dy, b2>, dH, dX~ = dH W1, dW1, dW2,
    the biases) is autograd's exactly once its quantizers are the identity: fp64, every gradient."""
    import moeblaze.reference.experts as ref

    monkeypatch.setattr(ref, "fake_quant_rows", lambda t: t)
    monkeypatch.setattr(ref, "fake_quant_blocks", lambda t: t)
    x, w1, w2, idx, w = random_problem(30, 16, 24, 5, 2, activation, dtype=torch.float64)
    b1 = torch.randn(5, w1.shape[1], dtype=torch.float64) if biases else None
    b2 = torch.randn(5, 16, dtype=torch.float64) if biases else None
    dy = torch.randn_like(x)

    def run(**kw):
        ins = [t.clone().requires_grad_() for t in (x, w1, w2, w.double()) + ((b1, b2) if biases else ())]
        bb = ins[4:] if biases else (None, None)
        out = moe_experts_reference(ins[0], idx, ins[3], ins[1], ins[2], *bb,
                                    experts=ExpertsConfig(activation=activation, **kw))
        return [out, *torch.autograd.grad(out, ins, dy)]

    for a, b in zip(run(precision="fp8", fp8_min_rows=0, checkpoint="preact-fp8" if preact_fp8 else "preact"), run()):
        assert rel_err(a, b) <= 1e-12  # identity quantisers, fp64 both: only the order of sums may differ


def test_fp8_gemm_emulation_error_is_the_formats():
    """With e4m3 quantizers: the output and every gradient within a few percent of fp64 (three mantissa bits per
    operand), and not equal to it."""
    x, w1, w2, idx, w = random_problem(64, 256, 128, 4, 2, dtype=torch.float64)
    dy = torch.randn_like(x)

    def run(**kw):
        ins = [t.clone().requires_grad_() for t in (x, w1, w2, w.double())]
        out = moe_experts_reference(ins[0], idx, ins[3], ins[1], ins[2], experts=ExpertsConfig(**kw))
        return [out, *torch.autograd.grad(out, ins, dy)]

    for name, a, b in zip(("out", "dx", "dw1", "dw2", "dw"), run(precision="fp8", fp8_min_rows=0), run()):
        # e4m3 keeps 3 mantissa bits: each operand errs by up to 2^-4 relative, 2-5% norm-wise over a GEMM's sums
        assert 1e-4 < rel_err(a, b) < 0.08, (name, rel_err(a, b))


@pytest.mark.parametrize("gather", [False, True])
def test_fp8_rows_gemm_kernel_matches_the_emulation(poison_alloc, gather):
    """The tl fp8 GEMM kernel's logic under the interpreter, its operands float16 holding the e4m3 values exactly:
    every row of every expert (an empty one, a ragged last tile, a K and an N that are not multiples of 128) equals
    reference.fp8's emulation, fake_quant_rows(A)[rows] · fake_quant_blocks(B[e])ᵀ, in fp32."""
    from moeblaze.experts.stages import RowPlan
    from moeblaze.experts.tl.fp8 import fp8_rows_gemm
    from moeblaze.reference import fake_quant_blocks, quantize_blocks

    g = torch.Generator().manual_seed(2)
    L, K, E, N, Kd = 40, 2, 4, 200, 300
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(L)]).int()  # expert 3 gets nothing
    routing = build_routing_index(idx, E)
    plan = RowPlan.build(routing)
    R = L * K
    a = torch.randn(L if gather else R, Kd, generator=g) * 3
    b = torch.randn(E, N, Kd, generator=g)
    a_q, a_s = quantize_rows(a)
    b_q, b_s = quantize_blocks(b)
    out = fp8_rows_gemm(a_q.to(torch.float32).half(), a_s, b_q.to(torch.float32).half(), b_s, R, plan.offsets_E1,
                        plan.sched, token=plan.token_R if gather else None, out_dtype=torch.float32)
    src = plan.token_R.long() if gather else torch.arange(R)
    want = torch.empty(R, N)
    experts = torch.repeat_interleave(torch.arange(E), routing.expert_counts.long())
    bq = fake_quant_blocks(b)
    for r in range(R):
        want[r] = fake_quant_rows(a[src[r]:src[r] + 1])[0] @ bq[experts[r]].t()
    assert rel_err(out, want) <= 1e-6  # the same e4m3 products, fp32 sums of 300 in another order: ~8 ulps


@pytest.mark.parametrize("activation,checkpoint,interleaved", [("swiglu", "preact", False),
                                                               ("swiglu", "preact-fp8", True),
                                                               ("gelu", "recompute", False)])
def test_precision_fp8_kernels_match_the_emulation(poison_alloc, activation, checkpoint, interleaved):
    """precision="fp8" on the kernels (interpreter) against the reference's emulation of the same recipe, fp32: the
    output and every gradient. The two quantize the same operands at the same points, but their fp32 sums run in
    different orders, so an element sitting on an e4m3 rounding boundary may round the other way (a 2^-4 step on
    that one element): 1e-3 relative bounds that, and is 30x below the recipe's own error (checked too)."""
    torch.manual_seed(0)
    x, w1, w2, idx, w = random_problem(48, 160, 96 if activation == "gelu" else 72, 5, 2, activation)
    routing = build_routing_index(idx, 5)
    dy = torch.randn_like(x)

    def run(**kw):
        ins = [t.clone().requires_grad_() for t in (x, w1, w2, w)]
        out = moe_experts(ins[0], routing, ins[3], ins[1], ins[2],
                          experts=ExpertsConfig(activation=activation, checkpoint=checkpoint, **kw),
                          interleaved=interleaved)
        return [out, *torch.autograd.grad(out, ins, dy)]

    got = run(backend="triton", precision="fp8", fp8_min_rows=0)
    emulated = run(backend="reference", precision="fp8", fp8_min_rows=0)
    exact = run(backend="reference")
    for name, g, e, r in zip(("out", "dx", "dw1", "dw2", "dw"), got, emulated, exact):
        assert rel_err(g, e) <= FP8_VS_EMULATION, (name, rel_err(g, e))
        assert 1e-4 < rel_err(g, r) < 0.1, (name, rel_err(g, r))


def test_precision_fp8_runs_native_gemms_where_the_experts_get_too_few_rows(poison_alloc):
    """precision="fp8" below fp8_min_rows rows per expert: the native GEMMs, on the kernels and in the reference
    alike (bitwise precision="native"'s output and gradients, no e4m3 launch); at fp8_min_rows = L·K/E exactly, and
    per chunk with chunk_tokens, the e4m3 GEMMs."""
    from moeblaze.experts import dispatch

    L, E, K = 48, 4, 2  # 24 rows per expert
    x, w1, w2, idx, w = random_problem(L, 128, 64, E, K, "swiglu")
    routing = build_routing_index(idx, E)
    dy = torch.randn_like(x)

    def run(**kw):
        ins = [t.clone().requires_grad_() for t in (x, w1, w2, w)]
        dispatch.launch_counts.clear()
        out = moe_experts(ins[0], routing, ins[3], ins[1], ins[2], experts=ExpertsConfig(**kw))
        grads = torch.autograd.grad(out, ins, dy)
        return [out, *grads], dispatch.launch_counts["fp8_rows", "tl"]

    for backend in ("triton", "reference"):
        natives = {chunk: run(backend=backend, chunk_tokens=chunk)[0] for chunk in (None, 24)}
        for rows, chunk, e4m3 in ((25, None, False), (24, None, True), (24, 24, False), (12, 24, True)):
            native = natives[chunk]
            got, fp8_launches = run(backend=backend, precision="fp8", fp8_min_rows=rows, chunk_tokens=chunk)
            same = all(torch.equal(a, b) for a, b in zip(got, native))
            assert same != e4m3, (backend, rows, chunk)
            if backend == "triton":
                assert (fp8_launches > 0) == e4m3, (rows, chunk, fp8_launches)


@pytest.mark.filterwarnings("ignore:token rounding with")
def test_precision_fp8_on_a_rounded_routing(poison_alloc):
    """A token-rounded routing (a dropped tail, tokens with 0 to 4K experts) under precision="fp8": the same as the
    emulation over the kept pairs."""
    from moeblaze.routing import route_topk
    from moeblaze.routing.rounding import round_tokens, rounded_index

    torch.manual_seed(3)
    L, D, H, E, K, M = 60, 128, 64, 4, 2, 16
    x, w1, w2 = torch.randn(L, D), torch.randn(E, 2 * H, D) / D ** 0.5, torch.randn(E, D, H) / H ** 0.5
    logits = torch.randn(L, E) * 2
    r = round_tokens(logits, *route_topk(logits, K), M, "up")
    index, wk, overflow = rounded_index(r.kept_LE, r.weights_LE, 2 * K, L * K + E * M)
    assert not overflow
    dy = torch.randn(L, D)

    def run(impl):
        ins = [t.clone().requires_grad_() for t in (x, w1, w2, wk)]
        config = ExpertsConfig(precision="fp8", fp8_min_rows=0, backend=impl)
        out = moe_experts(ins[0], index, ins[3], ins[1], ins[2], experts=config)
        return [out, *torch.autograd.grad(out, ins, dy)]

    for name, g, e in zip(("out", "dx", "dw1", "dw2", "dw"), run("triton"), run("reference")):
        assert rel_err(g, e) <= FP8_VS_EMULATION, (name, rel_err(g, e))


def test_layer_with_fp8_precision(poison_alloc):
    """MoELayer(precision="fp8") runs its routed experts through precision="fp8" (interpreter) and matches the same
    layer on the reference's emulation; shared experts stay native; extra_repr says so."""
    from moeblaze import MoELayer, SharedConfig

    torch.manual_seed(0)
    layers = {impl: MoELayer(128, 64, 4, 2, experts=ExpertsConfig(precision="fp8", fp8_min_rows=0, backend=impl),
                             shared=SharedConfig()) for impl in
              ("triton", "reference")}
    layers["reference"].load_state_dict(layers["triton"].state_dict())
    assert "precision='fp8'" in repr(layers["triton"].experts) and "precision" not in repr(layers["triton"].shared)
    x = torch.randn(2, 24, 128)
    res = {}
    for impl, layer in layers.items():
        xi = x.clone().requires_grad_()
        out = layer(xi).out
        res[impl] = [out, *torch.autograd.grad(out.square().sum(), [xi, *layer.parameters()])]
    for a, b in zip(res["triton"], res["reference"]):
        assert rel_err(a, b) <= FP8_VS_EMULATION
