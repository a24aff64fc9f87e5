"""What gpt-oss's experts need, on the Triton kernels under the interpreter against the fp64 reference, with
NaN-poisoned allocations: biases on both projections, gate/up rows interleaved, weights read through transposed
views (gradients written in the same layout), and the clamped SwiGLU with pre-activations past its limits."""
import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze.experts import moe_experts
from moeblaze.reference import CLAMP_LIMIT, moe_experts_dense, moe_experts_reference
from moeblaze.routing import build_routing_index

from helpers import random_problem, rel_err


def problem(L, D, H, E, K, activation, bias, transposed, scale=1.0, sentinels=0):
    """x, w1 (E, F, D), w2 (E, D, H) (transposed views of (E, D, F) and (E, H, D) storage where asked), idx, w,
    b1, b2: every float leaf a fresh fp32 tensor."""
    x, w1, w2, idx, w = random_problem(L, D, H, E, K, activation)
    x = x * scale
    if transposed:
        w1 = w1.transpose(1, 2).contiguous().transpose(1, 2)
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    b1 = torch.randn(E, w1.shape[1]) if bias else None
    b2 = torch.randn(E, D) if bias else None
    if sentinels:
        idx[torch.randperm(L)[:sentinels], -1] = E  # dropped pairs (expert-parallel sentinels)
    return x, w1, w2, idx, w, b1, b2


def run(L, D, H, E, K, activation="clamped_swiglu", interleaved=True, bias=True, transposed=True,
        checkpoint="preact", scale=4.0, sentinels=0, chunk_tokens=None):
    x, w1, w2, idx, w, b1, b2 = problem(L, D, H, E, K, activation, bias, transposed, scale, sentinels)
    leaves = [t for t in (x, w1, w2, w, b1, b2) if t is not None]
    ins = [t.detach().requires_grad_() for t in leaves]
    tri = dict(zip(("x", "w1", "w2", "w", "b1", "b2"), ins + [None] * (6 - len(ins))))
    routing = build_routing_index(idx, E, sentinels=bool(sentinels))
    out = moe_experts(tri["x"], routing, tri["w"], tri["w1"], tri["w2"], tri["b1"], tri["b2"],
                      experts=ExpertsConfig(activation=activation, checkpoint=checkpoint, chunk_tokens=chunk_tokens,
                                           backend="triton"), interleaved=interleaved)
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, ins, dy)
    ref_ins = [t.detach().double().requires_grad_() for t in leaves]
    ref = dict(zip(("x", "w1", "w2", "w", "b1", "b2"), ref_ins + [None] * (6 - len(ins))))
    keep = idx < E
    ref_out = moe_experts_reference(ref["x"], idx.clamp(max=E - 1), ref["w"] * keep, ref["w1"], ref["w2"], ref["b1"],
                                    ref["b2"], experts=ExpertsConfig(activation=activation), interleaved=interleaved)
    ref_grads = torch.autograd.grad(ref_out, ref_ins, dy.double())
    names = ["out", "dx", "dw1", "dw2", "dtopk_w", "db1", "db2"][:len(ins) + 1]
    errs = {n: rel_err(a, b) for n, a, b in zip(names, (out,) + grads, (ref_out,) + ref_grads)}
    if sentinels:  # a dropped pair's router weight gets no gradient
        assert torch.count_nonzero(grads[3][~keep]) == 0
    return errs, ins, grads


def assert_close(errs, tol=1e-5):
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"relative errors over {tol}: {bad}"


@pytest.mark.parametrize("checkpoint", ["preact", "recompute"])
def test_gpt_oss_experts(poison_alloc, checkpoint):
    """Biases, interleaved gate/up, transposed weights and the clamped SwiGLU together, as gpt-oss has them."""
    errs, ins, grads = run(45, 40, 24, 6, 2, checkpoint=checkpoint)
    assert_close(errs)
    for leaf, g in zip(ins, grads):  # gradients in the leaves' own layouts: no copy to reach the parameter's
        assert g.stride() == leaf.stride()


@pytest.mark.parametrize("activation,interleaved,bias,transposed", [
    ("swiglu", True, False, False),  # interleaved alone
    ("swiglu", False, True, False),  # biases alone
    ("geglu", False, False, True),  # transposed views alone
    ("gelu", False, True, True),  # a plain activation with biases
    ("clamped_swiglu", False, False, False),  # the clamped activation alone, gate rows first
])
def test_each_feature_alone(poison_alloc, activation, interleaved, bias, transposed):
    assert_close(run(37, 32, 16, 5, 2, activation, interleaved, bias, transposed, scale=4.0)[0])


def test_clamps_are_exercised():
    """The problems above reach past the clamp limits on both sides, so the clamped branches are tested."""
    x, w1, _, _, _, b1, _ = problem(45, 40, 24, 6, 2, "clamped_swiglu", True, True, 4.0)
    h = torch.einsum("ld,efd->lef", x, w1) + b1
    gate, up = h[..., ::2], h[..., 1::2]
    assert (gate > CLAMP_LIMIT).any() and (up > CLAMP_LIMIT).any() and (up < -CLAMP_LIMIT).any()


def test_sentinels_and_chunks_with_biases(poison_alloc):
    """Dropped pairs add no bias and get no gradient; chunked runs carry the biases and the layout."""
    assert_close(run(41, 32, 16, 5, 3, sentinels=9)[0])
    assert_close(run(41, 32, 16, 5, 3, chunk_tokens=16, checkpoint="recompute")[0])


@pytest.mark.parametrize("interleaved", [False, True])
def test_reference_with_biases_matches_dense(interleaved):
    x, w1, w2, idx, w, b1, b2 = problem(23, 12, 10, 5, 2, "clamped_swiglu", True, True, 4.0)
    args = [t.double() for t in (x, w1, w2, w, b1, b2)]
    x, w1, w2, w, b1, b2 = args
    assert rel_err(moe_experts_reference(x, idx, w, w1, w2, b1, b2, experts=ExpertsConfig(activation="clamped_swiglu"),
                                         interleaved=interleaved),
                   moe_experts_dense(x, idx, w, w1, w2, b1, b2, experts=ExpertsConfig(activation="clamped_swiglu"),
                                     interleaved=interleaved)) < 1e-12  # fp64 both: sums reordered, a few ulps


def test_reference_gradcheck_with_biases():
    x, w1, w2, idx, w, b1, b2 = problem(6, 5, 4, 3, 2, "swiglu", True, False)
    args = [t.double().requires_grad_() for t in (x, w1, w2, w, b1, b2)]
    fn = lambda x, w1, w2, w, b1, b2: moe_experts_reference(x, idx, w, w1, w2, b1, b2, interleaved=True)  # noqa: E731
    # fp64 central differences at eps 1e-6 err by ~eps² + 2^-52 / eps (1e-10): torch's default atol 1e-5, 10x tighter
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad,message", [
    (dict(b1=torch.zeros(5, 7)), "b1 must be a tensor of shape"),
    (dict(b2=torch.zeros(5, 31)), "b2 must be a tensor of shape"),
    (dict(b2=torch.zeros(5, 32, dtype=torch.float64)), "b2 dtype"),
    (dict(activation="gelu", interleaved=True), "interleaved gate/up rows need a gated activation"),
])
def test_bad_bias_or_layout_is_refused(bad, message):
    activation = bad.pop("activation", "swiglu")
    x, w1, w2, idx, w = random_problem(9, 32, 16, 5, 2, activation)
    with pytest.raises((ValueError, TypeError), match=message):
        moe_experts(x, build_routing_index(idx, 5), w, w1, w2, experts=ExpertsConfig(activation=activation), **bad)


def test_zeroed_tail_covers_every_weight_gradient_row_block():
    """Backward zeroes TAIL_ROWS rows past the last expert's end of a routing with dropped pairs: the weight-gradient
    kernels read at most one row block (BLOCK_K) there, so TAIL_ROWS must cover every config's block."""
    import inspect

    from moeblaze.experts.op import TAIL_ROWS
    from moeblaze.experts.gluon_sm90.wgrad import weight_grad
    from moeblaze.experts.tl.configs import WGRAD_CONFIGS

    assert max(c.kwargs["BLOCK_K"] for c in WGRAD_CONFIGS) <= TAIL_ROWS
    assert inspect.signature(weight_grad).parameters["block_k"].default <= TAIL_ROWS


def test_zeroing_the_tail_leaves_every_kept_row():
    """Rows from `first` on are zeroed (at most TAIL_ROWS of them), none before it, also where no row is past it."""
    from moeblaze.experts.op import TAIL_ROWS, _zero_rows_from

    for R, first in ((10, 10), (10, 9), (10, 0), (TAIL_ROWS + 40, 20), (0, 0)):
        t = torch.arange(1, R * 3 + 1, dtype=torch.float32).view(R, 3)
        want = t.clone()
        want[first:first + TAIL_ROWS] = 0
        _zero_rows_from(t, torch.tensor([first], dtype=torch.int32))
        assert torch.equal(t, want), (R, first)


@pytest.mark.parametrize("checkpoint,chunk,backend", [("preact", None, "triton"), ("recompute", None, "triton"),
                                                      ("preact", 5, "triton"), ("recompute", None, "reference")])
def test_w1_in_two_parts_equals_w1_whole(poison_alloc, checkpoint, chunk, backend):
    """torchtitan's layout: W1's gate rows and up rows as two tensors. Output and every gradient equal, bit for bit,
    to the same W1 given whole, and each part gets its half of dW1."""
    L, D, H, E, K = 13, 32, 24, 4, 2
    x, w1, w2, idx, w = random_problem(L, D, H, E, K, "swiglu")
    config = ExpertsConfig(checkpoint=checkpoint, chunk_tokens=chunk, backend=backend)
    routing = build_routing_index(idx, E)
    dy = torch.randn(L, D)

    def grads(parts: bool):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w1[:, :H], w1[:, H:], w2, w)]
        xl, gate, up, w2l, wl = leaves
        w1_arg = (gate, up) if parts else torch.cat((gate, up), 1)
        out = moe_experts(xl, routing, wl, w1_arg, w2l, experts=config)
        return [out, *torch.autograd.grad(out, leaves, dy)]

    for a, b in zip(grads(True), grads(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad,message", [
    (lambda g, u: (g, u[:, :-1]), "one shape"),
    (lambda g, u: (g, u, u), "pair of tensors"),
    (lambda g, u: (g, u.double()), "up part"),
])
def test_w1_parts_are_checked(bad, message):
    x, w1, w2, idx, w = random_problem(6, 16, 8, 4, 2, "swiglu")
    with pytest.raises((ValueError, TypeError), match=message):
        moe_experts(x, build_routing_index(idx, 4), w, bad(w1[:, :8], w1[:, 8:]), w2)
    with pytest.raises(ValueError, match="gated activation"):
        moe_experts(x, build_routing_index(idx, 4), w, (w1[:, :8], w1[:, 8:]), w2, interleaved=True)


def test_w1_in_two_parts_through_torch_compile():
    """The custom ops (what torch.compile traces) with W1 in two parts: equal to eager, both parts' gradients."""
    L, D, H, E, K = 12, 16, 8, 4, 2
    x, w1, w2, idx, w = random_problem(L, D, H, E, K, "swiglu")
    gate, up = (t.detach().clone().requires_grad_() for t in (w1[:, :H], w1[:, H:]))
    routing = build_routing_index(idx, E)

    def f(x, gate, up):
        return moe_experts(x, routing, w, (gate, up), w2, experts=ExpertsConfig(backend="triton"), check=False)

    outs = [fn(x, gate, up) for fn in (torch.compile(f, fullgraph=True, backend="aot_eager"), f)]
    grads = [torch.autograd.grad(o.square().sum(), (gate, up)) for o in outs]
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
