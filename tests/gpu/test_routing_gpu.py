"""On a CUDA GPU (`pytest -m gpu`): layers with today's routers and shared experts in bf16 on the compiled
kernels, against the same layer in fp32 on the reference (same weights, same routing: the router runs in fp32 on
both), within FACTOR x the error of the bf16 reference layer; the training step of such a layer, and of a token-rounded
one, holds no host sync (the expert-bias count and the sequence loss included); bf16 logits equal fp32 ones."""
import copy

import pytest
import torch

from moeblaze import ExpertsConfig, RoundingConfig, SharedConfig
from moeblaze import MoELayer
from moeblaze.routing import ROUTERS

from helpers import ROUTING_GRAD_RTOL, ROUTING_WEIGHTS_RTOL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FACTOR = 2.0


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _step(layer, x, dy):
    x = x.clone().requires_grad_()
    out = layer(x).out
    out.backward(dy)
    return [out, x.grad] + [p.grad for _, p in sorted(layer.named_parameters())]


@pytest.mark.parametrize("router,shared,gate", [("deepseek-v3", 1, False), ("qwen3-next", 1, True),
                                                ("gpt-oss", 0, False), ("olmoe", 2, True)])
def test_routers_and_shared_experts_bf16(router, shared, gate):
    torch.manual_seed(0)
    make = lambda impl: MoELayer(1024, 512, 64, 4, experts=ExpertsConfig(backend=impl), router=ROUTERS[router],
                                 shared=SharedConfig(shared, 768, gate) if shared else None).cuda()
    ours = make("triton")
    with torch.no_grad():
        if gate:
            ours.shared.gate.normal_(std=0.05)
        if ours.router.bias is not None:
            ours.router.bias.normal_(std=0.1)
    ref32 = make("reference")
    ref32.load_state_dict(ours.state_dict())
    ref16 = copy.deepcopy(ref32).bfloat16()
    ours = ours.bfloat16()
    x = torch.randn(2, 2048, 1024, device="cuda")
    dy = torch.randn_like(x)
    want = _step(ref32, x, dy)
    bound = [FACTOR * _rel(a, r) + 1e-4 for a, r in zip(_step(ref16, x.bfloat16(), dy.bfloat16()), want)]
    got = _step(ours, x.bfloat16(), dy.bfloat16())
    for i, (a, r, b) in enumerate(zip(got, want, bound)):
        assert torch.isfinite(a).all() and _rel(a, r) <= b, (i, _rel(a, r), b)


def test_router_step_never_syncs_with_host():
    torch.manual_seed(0)
    layer = MoELayer(512, 256, 32, 4, router=ROUTERS["deepseek-v3"], shared=SharedConfig(gated=True)).cuda()
    layer = layer.bfloat16()
    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).out.sum().backward()  # compile and warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m = layer(x)
        (m.out.float().sum() + m.aux_loss + m.z_loss).backward()
        layer.router.update_expert_bias()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert layer.router.expert_bias.abs().sum() > 0


@pytest.mark.filterwarnings("ignore:token rounding with")
@pytest.mark.parametrize("backend", ["tl", "gluon"])
@pytest.mark.parametrize("rule,checkpoint", [("nr-f", "preact"), ("up", "recompute"), ("down", "preact")])
def test_token_rounding_through_the_kernels_bf16(poison_alloc, backend, rule, checkpoint):
    """A rounded routing (tokens with 0 to 4K experts, a static row buffer with a dropped tail, fresh buffers NaN)
    through the bf16 kernels, three steps in a row: output and every gradient (x, w1, w2, and the logits through the
    weights) finite and within FACTOR x the bf16 reference's error against the fp32 dense sum over the kept pairs."""
    from moeblaze.experts import moe_experts
    from moeblaze.routing import route_topk
    from moeblaze.routing.rounding import round_tokens_fast, rounded_index, rounded_rows_bound
    from moeblaze.experts.schedule import BLOCK_M

    if backend == "gluon" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Gluon kernels: Hopper only")
    torch.manual_seed(0)
    L, D, H, E, K = 4096, 256, 128, 64, 4
    x = torch.randn(L, D, device="cuda")
    w1, w2 = torch.randn(E, 2 * H, D, device="cuda") / D ** 0.5, torch.randn(E, D, H, device="cuda") / H ** 0.5
    logits = (torch.randn(L, E, device="cuda") * 2).requires_grad_()
    dy = torch.randn(L, D, device="cuda")

    def run(dtype, impl, fresh_logits):
        lg = logits.detach().clone().requires_grad_() if fresh_logits else logits
        idx, w = route_topk(lg, K)
        r = round_tokens_fast(lg, idx, w, BLOCK_M, rule)
        index, wk, overflow = rounded_index(r.kept_LE, r.weights_LE, 4 * K, rounded_rows_bound(L, K, E, BLOCK_M, rule))
        assert not bool(overflow)
        ins = [t.to(dtype).requires_grad_() for t in (x, w1, w2)]
        out = moe_experts(ins[0], index, wk, ins[1], ins[2], experts=ExpertsConfig(checkpoint=checkpoint,
                                                                                  backend=backend))
        grads = torch.autograd.grad(out, ins + [lg], dy.to(dtype))
        return [out] + list(grads)

    want = run(torch.float32, "reference", True)
    ref_bf16 = run(torch.bfloat16, "reference", True)
    for _ in range(3):  # later steps reuse freed blocks: what a kernel reads but should not shows up there
        got = run(torch.bfloat16, "triton", True)
        for name, g, b, w in zip(("out", "dx", "dw1", "dw2", "dlogits"), got, ref_bf16, want):
            assert torch.isfinite(g).all(), name
            assert _rel(g, w) <= FACTOR * max(_rel(b, w), 1e-3), (name, _rel(g, w), _rel(b, w))


def test_bf16_router_logits_on_gpu_within_the_bound_of_their_fp32_sums():
    """On CUDA the bf16 router's logits come from a bf16 GEMM accumulating in fp32 and its gradients from two bf16
    terms of the fp32 gradient. Tensor cores add each 16-deep step's exact products to the fp32 sum with truncation,
    so the logits may sit up to (K / 16) · 2^-23 · sum_k |x_k w_k| from the exact ones (the CPU tests' model of that
    accumulation: 1.4e-5 at most, the fp32 GEMM 1.2e-6, a bf16 rounding of them up to 1e-2); the gradients are the
    exact ones' bf16 rounding almost everywhere (modelled: 0.3% miss; a plain bf16 cast of the gradient ~40%)."""
    from moeblaze.routing.router import router_logits

    torch.manual_seed(0)
    x = torch.randn(8192, 2048, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(256, 2048, device="cuda") * 2048 ** -0.5).bfloat16().requires_grad_()
    dy = torch.randn(8192, 256, device="cuda")
    logits = router_logits(x, w)
    xd, wd = x.detach().double(), w.detach().double()
    bound = (2048 / 16) * 2.0 ** -23 * (xd.abs() @ wd.abs().t())
    err = (logits.double() - xd @ wd.t()).abs()
    assert logits.dtype == torch.float32 and (err <= bound).all(), (err.max().item(), (err / bound).max().item())
    dx, dw = torch.autograd.grad(logits, (x, w), dy)
    for got, exact in ((dx, dy.double() @ wd), (dw, dy.double().t() @ xd)):
        misses = (got != exact.to(torch.bfloat16)).float().mean().item()
        assert misses < 0.02, misses  # 2^-16 of exact: a bf16 rounding flips at odds ~0.8% (test_router.py)


@pytest.mark.filterwarnings("ignore:token rounding with")
@pytest.mark.parametrize("rule", ["nr-f", "up", "down"])
def test_token_rounding_step_never_syncs_with_host(rule):
    torch.manual_seed(0)
    layer = MoELayer(512, 256, 32, 4, rounding=RoundingConfig(rule)).cuda().bfloat16()
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).out.float().sum().backward()  # compile and warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m = layer(x)
        (m.out.float().sum() + m.aux_loss + m.z_loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.filterwarnings("ignore:token rounding with")
@pytest.mark.parametrize("scoring", ["softmax_topk", "sigmoid_topk", "topk_softmax"])
@pytest.mark.parametrize("L,E,K,cap", [(8192, 128, 8, 32), (16384, 256, 4, 16), (4096, 64, 4, 5)])
def test_round_to_index_compiled_equals_rounding_then_index(poison_alloc, scoring, L, E, K, cap):
    """The compiled rounding kernels against rounded_index(round_tokens_fast(...)) on the same GPU, fresh buffers
    NaN, every rule: the same index, the weights to fp32 rounding, the logits' gradient through the weights to
    1e-5 (the bound on experts per token binds at cap 5: tokens that score high everywhere)."""
    from moeblaze.experts.schedule import BLOCK_M
    from moeblaze.routing import round_to_index, route_topk
    from moeblaze.routing.rounding import round_tokens_fast, rounded_index, rounded_rows_bound

    torch.manual_seed(0)
    for rule in ("nr-f", "up", "down"):
        logits = torch.randn(L, E, device="cuda") * 2
        logits[:7] += 6.0
        logits.requires_grad_()
        idx, w = route_topk(logits, K, scoring, route_scale=2.5)
        rows = rounded_rows_bound(L, K, E, BLOCK_M, rule)
        rr = round_tokens_fast(logits, idx, w, BLOCK_M, rule, scoring, True, 2.5, max_experts=cap)
        want = rounded_index(rr.kept_LE, rr.weights_LE, cap, rows)
        got = round_to_index(logits, idx, w, BLOCK_M, rule, scoring, True, 2.5, max_experts=cap, max_rows=rows)
        for f in ("expert_counts", "expert_offsets", "expert_token_idx", "token_slot"):
            assert torch.equal(getattr(got[0], f), getattr(want[0], f)), (f, rule)
        assert not bool(got[2]) and not bool(want[2])
        torch.testing.assert_close(got[1], want[1], rtol=ROUTING_WEIGHTS_RTOL, atol=0)
        dw = torch.randn(L, cap, device="cuda")
        g_want = torch.autograd.grad((want[1] * dw).sum(), logits, retain_graph=True)[0]
        g_got = torch.autograd.grad((got[1] * dw).sum(), logits)[0]
        assert float((g_got - g_want).norm()) <= ROUTING_GRAD_RTOL * float(g_want.norm()), rule


@pytest.mark.filterwarnings("ignore:token rounding with")
@pytest.mark.parametrize("rule", ["nr-f", "up"])
def test_token_rounding_layer_compiles_with_fullgraph(rule):
    """The rounded layer's step under torch.compile(fullgraph=True) (the rounding kernels and the weights' autograd
    Function traced, not a graph break): output and gradients equal to eager's (aot_eager: the same ops, so the
    same routing)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = MoELayer(512, 256, 32, 4, rounding=RoundingConfig(rule)).cuda().bfloat16()
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager = layer(x)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(compiled.out, eager.out)
    params = (x, layer.w1, layer.router.weight)
    g_e = torch.autograd.grad(eager.out.float().square().sum() + eager.aux_loss, params)
    g_c = torch.autograd.grad(compiled.out.float().square().sum() + compiled.aux_loss, params)
    for a, b in zip(g_c, g_e):
        assert _rel(a, b) < 1e-6  # the same ops (aot_eager): fp32 gradients a few ulps (2^-23) apart at most
