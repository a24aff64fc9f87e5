"""The fp8 weight-gradient pieces (interpreter): quant.quantize_tiles_t against reference.fp8.quantize_rows of each
tile's transposed rows, bit for bit, and tl.fp8.fp8_weight_grad against the reference's emulation of the weight
gradients (fake_quant_rows of each expert's Pᵀ and Qᵀ, the 128 x 1 groups starting at its first row)."""
import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze.experts.schedule import tile_schedule
from moeblaze.experts.stages import RowPlan
from moeblaze.experts.tl import quant
from moeblaze.experts.tl.fp8 import fp8_weight_grad
from moeblaze.reference import fake_quant_rows, quantize_rows
from moeblaze.routing import build_routing_index

from helpers import rel_err


def _plan(L, E, K, seed):
    """(the routing's row plan, its schedule of 128-row tiles (the weight gradients' groups, whatever the kernels'
    own row tile), a generator)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(L, E, generator=g)
    logits[:, 1] = -1e4  # an empty expert
    logits[: L // 2, 0] += 6  # a large one: several tiles
    index = build_routing_index(logits.topk(K, dim=1).indices, E)
    return RowPlan.build(index), tile_schedule(index.expert_counts, index.expert_offsets, L * K, 128), g


@pytest.mark.parametrize("gathered", [False, True])
def test_quantize_tiles_t_is_each_tiles_transposed_rows_quantized(poison_alloc, gathered):
    L, E, K, N = 300, 5, 2, 200
    plan, sched, g = _plan(L, E, K, 3)
    R = L * K
    a = torch.randn(L if gathered else R, N, generator=g) * torch.logspace(-2, 2, N)[None, :]
    a[:, 7] = 0  # a zero column: its scale is the floor
    token = plan.token_R if gathered else None
    q, s = quant.quantize_tiles_t(a, sched, plan.offsets_E1, token)
    assert s.stride() == (1, 256)  # a tile's scales contiguous, padded to 256 columns with zeros
    assert (s.as_strided((s.shape[1], 256), (256, 1))[:, N:] == 0).all()
    rows_a = a[plan.token_R.long()] if gathered else a
    te, tr = sched[0].tolist(), sched[1].tolist()
    used, off = int(sched[2]), plan.offsets_E1.tolist()
    assert used > E - 1  # the large expert spans several tiles
    for t in range(used):
        r0, r1 = tr[t], min(tr[t] + 128, off[te[t] + 1])
        want_q, want_s = quantize_rows(rows_a[r0:r1].t().contiguous())
        assert torch.equal(s[:, t], want_s[:, 0])
        assert torch.equal(q[:, t * 128:t * 128 + r1 - r0].float(), want_q.float())
        assert (q[:, t * 128 + r1 - r0:(t + 1) * 128].float() == 0).all()  # past the expert's end


def test_fp8_weight_grad_matches_the_emulation(poison_alloc):
    """dW[e] = P[rows]ᵀ Q[rows] on e4m3 operands scaled per 128 rows: the reference's arithmetic (fp32 sums in
    another order: 1e-5 relative), and an expert without rows gets zeros."""
    L, E, K, N, P = 300, 5, 2, 72, 40
    plan, sched, g = _plan(L, E, K, 4)
    R = L * K
    p_rows, q_tok = torch.randn(R, N, generator=g), torch.randn(L, P, generator=g)
    out = torch.full((E, N, P), float("nan"))
    fp8_weight_grad(quant.quantize_tiles_t(p_rows, sched, plan.offsets_E1),
                    quant.quantize_tiles_t(q_tok, sched, plan.offsets_E1, plan.token_R), plan.offsets_E1, out)
    off, q_rows = plan.offsets_E1.tolist(), q_tok[plan.token_R.long()]
    for e in range(E):
        pe, qe = p_rows[off[e]:off[e + 1]], q_rows[off[e]:off[e + 1]]
        want = fake_quant_rows(pe.t()) @ fake_quant_rows(qe.t()).t()
        if off[e] == off[e + 1]:
            assert (out[e] == 0).all()
        else:
            assert rel_err(out[e], want) <= 1e-5, (e, rel_err(out[e], want))
            assert rel_err(out[e], pe.t() @ qe) > 1e-3  # e4m3 does show


@pytest.mark.parametrize("checkpoint", ["preact", "preact-fp8"])
def test_precision_fp8_with_fp8_weight_gradients_matches_the_emulation(poison_alloc, checkpoint):
    """moe_experts(precision="fp8", fp8_wgrad=True) on the kernels against the reference's emulation of the same
    recipe (fp32; the bound of test_precision_fp8_kernels_match_the_emulation), and its weight gradients differ
    from fp8_wgrad=False's by the e4m3 of their operands."""
    from moeblaze.experts import moe_experts

    from helpers import random_problem

    torch.manual_seed(0)
    x, w1, w2, idx, w = random_problem(160, 128, 72, 4, 2)
    routing = build_routing_index(idx, 4)
    dy = torch.randn_like(x)

    def run(**kw):
        ins = [t.clone().requires_grad_() for t in (x, w1, w2, w)]
        out = moe_experts(ins[0], routing, ins[3], ins[1], ins[2],
                          config=ExpertsConfig(checkpoint=checkpoint, precision="fp8", **kw))
        return [out, *torch.autograd.grad(out, ins, dy)]

    got = run(backend="triton", fp8_wgrad=True)
    emulated = run(backend="reference", fp8_wgrad=True)
    plain = run(backend="triton")
    for name, g, e in zip(("out", "dx", "dw1", "dw2", "dw"), got, emulated):
        assert rel_err(g, e) <= 1e-3, (name, rel_err(g, e))
    for i in (0, 1, 4):  # out, dx, dS: the same arithmetic as without it
        assert torch.equal(got[i], plain[i])
    for i in (2, 3):
        assert 1e-3 < rel_err(got[i], plain[i]) < 0.1
    with pytest.raises(ValueError, match="fp8_wgrad"):
        moe_experts(x, routing, w, w1, w2, config=ExpertsConfig(fp8_wgrad=True, backend="triton"))


def test_the_hopper_weight_gradient_takes_only_padded_tile_major_scales(monkeypatch):
    """The dispatcher sends quantize_tiles_t's operands to the Gluon kernel (which reads each tile's scales
    unmasked, up to whole tiles of dW) and keeps scales stored any other way, or a strided dW, on tl."""
    from moeblaze.experts import dispatch

    monkeypatch.setattr(dispatch, "resolve", lambda backend, device: "gluon")  # as on an sm_90 GPU
    plan, sched, g = _plan(300, 5, 2, 5)
    a_t = quant.quantize_tiles_t(torch.randn(600, 200, generator=g), sched, plan.offsets_E1)
    b_t = quant.quantize_tiles_t(torch.randn(300, 72, generator=g), sched, plan.offsets_E1, plan.token_R)
    out = torch.empty(5, 200, 72)
    assert dispatch.fp8_weight_grad("auto", a_t, b_t, out) == "gluon"
    unpadded = (a_t[0], a_t[1].contiguous())  # (N, T) row-major: a column's scales contiguous instead
    assert dispatch.fp8_weight_grad("auto", unpadded, b_t, out) == "tl"
    assert dispatch.fp8_weight_grad("auto", a_t, b_t, torch.empty(5, 72, 200).transpose(1, 2)) == "tl"
