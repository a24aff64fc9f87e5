"""Every kernel under Triton's integer-overflow sanitizer with its assertions on (debug=True: the interpreter
recomputes each int32 add, sub and mul in int64 and asserts it in range, and the kernels' own device asserts run).
Elsewhere the suite sets the sanitizer aside (helpers.speed_up_triton_interpreter): without debug=True its
assertions never ran, and its arithmetic was half of the interpreted kernels' time. Here: the experts' forward and
backward at every activation, checkpoint policy and precision, with biases, chunks and dropped pairs, and the
routing index's and token rounding's kernels, each checked against the reference."""
import pytest
import torch
import triton
import triton.language as tl

from moeblaze import ExpertsConfig
from moeblaze.configs import ACTIVATIONS, CHECKPOINTS
from moeblaze.experts import launch_counts, moe_experts
from moeblaze.reference import moe_experts_reference, up_width
from moeblaze.routing import build_routing_index, round_to_index, route_topk
from moeblaze.routing.rounding import round_tokens, rounded_index

from helpers import ROUTING_WEIGHTS_RTOL, interpreter_overflow_checks, rel_err


@triton.jit
def _overflowing_mul(x_ptr, out_ptr):
    x = tl.load(x_ptr)
    tl.store(out_ptr, x * x)


def test_the_sanitizer_is_on_here_and_aside_elsewhere():
    x, out = torch.tensor([70000], dtype=torch.int32), torch.empty(1, dtype=torch.int32)
    _overflowing_mul[(1,)](x, out)  # wraps silently: the sanitizer is aside
    with interpreter_overflow_checks(), pytest.raises(Exception, match="overflow"):
        _overflowing_mul[(1,)](x, out)


def _problem(L, D, H, E, K, activation, seed, dropped=False, bias=False):
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(L, E, generator=g).topk(K, 1).indices.int()
    if dropped:  # some pairs to an id past the experts: dropped
        idx[::3, 0] = E
    x = torch.randn(L, D, generator=g)
    w1 = torch.randn(E, up_width(activation, H), D, generator=g) / D ** 0.5
    w2 = torch.randn(E, D, H, generator=g) / H ** 0.5
    w = torch.rand(L, K, generator=g) + 0.1
    b1 = torch.randn(E, up_width(activation, H), generator=g) if bias else None
    b2 = torch.randn(E, D, generator=g) if bias else None
    return idx, [x, w1, w2, w], b1, b2, torch.randn(L, D, generator=g)


CASES = ([(a, c, "native", None, False, False) for a in ACTIVATIONS for c in CHECKPOINTS]
         + [("swiglu", c, "fp8", None, True, False) for c in CHECKPOINTS]
         + [("geglu", "preact", "native", 8, True, False), ("swiglu", "recompute", "native", None, False, True),
            ("gelu", "preact", "fp8", 8, False, True)])


@pytest.mark.usefixtures("poison_alloc")
@pytest.mark.parametrize("activation,checkpoint,precision,chunk,bias,dropped", CASES)
def test_the_experts_kernels_pass_the_sanitizer(activation, checkpoint, precision, chunk, bias, dropped):
    E, K = 4, 2
    idx, ins, b1, b2, dy = _problem(24, 128 if precision == "fp8" else 16, 128 if precision == "fp8" else 8, E, K,
                                    activation, seed=len(activation) + len(checkpoint), dropped=dropped, bias=bias)
    cfg = ExpertsConfig(activation=activation, checkpoint=checkpoint, precision=precision, chunk_tokens=chunk,
                        backend="triton", **({"fp8_min_rows": 0} if precision == "fp8" else {}))
    leaves = [t.clone().requires_grad_() for t in ins]
    launch_counts.clear()
    with interpreter_overflow_checks():
        routing = build_routing_index(idx, E, sentinels=dropped)
        out = moe_experts(leaves[0], routing, leaves[3], leaves[1], leaves[2], b1, b2, experts=cfg)
        grads = torch.autograd.grad(out, leaves, dy)
    assert sum(launch_counts.values()) >= 6, launch_counts  # the kernels ran (forward and backward)
    fp8 = precision == "fp8"  # against the reference's emulation of e4m3, in fp32 (as test_preact_fp8), else fp64
    ref_ins = [(t.float() if fp8 else t.double()).requires_grad_() for t in ins]
    keep = idx < E  # a dropped pair: weight 0 in the reference
    ref = moe_experts_reference(ref_ins[0], idx.clamp(max=E - 1), ref_ins[3] * keep, ref_ins[1], ref_ins[2],
                                *(None if b is None else b.to(ref_ins[0].dtype) for b in (b1, b2)),
                                experts=cfg.replace(backend="reference", chunk_tokens=None))
    ref_grads = torch.autograd.grad(ref, ref_ins, dy.to(ref_ins[0].dtype))
    tol = 1e-3 if fp8 else 1e-5
    for name, a, b in zip(("out", "dx", "dw1", "dw2", "dtopk_w"), (out, *grads), (ref, *ref_grads)):
        assert torch.isfinite(a).all() and rel_err(a, b) <= tol, (name, rel_err(a, b))


@pytest.mark.parametrize("rule", ["nr-f", "up", "down"])
def test_the_routing_kernels_pass_the_sanitizer(rule):
    torch.manual_seed(0)
    logits = torch.randn(64, 8)
    idx, w = route_topk(logits, 2)
    with interpreter_overflow_checks():
        dense = build_routing_index(idx, 8, "dense")
        got, w_got, over = round_to_index(logits, idx, w, 16, rule, max_experts=8, max_rows=64 * 2 + 8 * 16)
    sort = build_routing_index(idx, 8, "sort")
    assert all(torch.equal(a, b) for a, b in zip(dense.tensors(), sort.tensors()))
    rr = round_tokens(logits, idx, w, 16, rule)
    want, w_want, _ = rounded_index(rr.kept_LE, rr.weights_LE, 8, 64 * 2 + 8 * 16)
    assert not over and torch.equal(got.token_slot, want.token_slot)
    torch.testing.assert_close(w_got, w_want, rtol=ROUTING_WEIGHTS_RTOL, atol=0)
