"""A kernel backend added through the registry alone (experts.backends): the stages written in torch over the row
plan (dA''s epilogue borrowed from tl) become ExpertsConfig(backend=...), run every launch they take, fall back to
tl for the ones they refuse, and give the reference's results within torch's own error."""
import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze.experts import backends, dispatch, launch_counts, moe_experts
from moeblaze.experts.tl import launchers as tl
from moeblaze.reference import apply_activation, is_gated
from moeblaze.routing import build_routing_index

from helpers import assert_within_torch_error, random_problem

NAME = "torch-stages"


def _experts(plan):
    """(e, first row, end row) of each expert, on the host (a test backend may read them)."""
    offsets = plan.offsets_E1.tolist()
    return [(e, a, b) for e, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])) if b > a]


class TorchStages:
    """Every GEMM stage as torch matmuls over each expert's rows; dx_rows and fp8_rows refused (tl runs them)."""
    name = NAME
    needs = "nothing"

    def available(self, device):
        return True

    def preferred(self, device):
        return False  # never chosen by backend="auto"

    def takes_up(self, *args, **kwargs):
        return True

    takes_down = takes_down_bwd = takes_weight_grad = takes_up

    def takes_dx_rows(self, *args, **kwargs):
        return False

    takes_fp8_rows = takes_dx_rows

    def up(self, plan, x, w1, activation, store_preact, store_act, *, b1_EF=None, interleaved=False, w1_up=None):
        w1 = w1 if w1_up is None else torch.cat((w1, w1_up), 1)
        preact = x.new_zeros(plan.num_rows, w1.shape[1])
        for e, a, b in _experts(plan):
            preact[a:b] = x[plan.token_R[a:b].long()] @ w1[e].t() + (0 if b1_EF is None else b1_EF[e])
        act = apply_activation(preact, activation, interleaved)
        return (preact if store_preact else x.new_empty(0)), (act if store_act else x.new_empty(0))

    def down(self, plan, act, w2):
        y = act.new_zeros(plan.num_rows, w2.shape[1])
        for e, a, b in _experts(plan):
            y[a:b] = act[a:b] @ w2[e].t()
        return y

    def dx_rows(self, plan, dpreact, w1, *, w1_up=None):
        raise AssertionError("refused: tl runs it")

    def down_bwd(self, plan, dy, w2, preact, topk_w, dpreact, activation, *, interleaved=False, preact_scale=None):
        dact = dy.new_zeros(plan.num_rows, w2.shape[2])
        for e, a, b in _experts(plan):
            dact[a:b] = dy[plan.token_R[a:b].long()] @ w2[e]
        ds = tl.act_bwd(dact, preact, plan.token_R, plan.token_slot_LK, topk_w, dpreact, dact, activation,
                        interleaved=interleaved, preact_scale=preact_scale)
        return dact, ds

    def weight_grad(self, plan, p, q, out, gather_p, *, out_up=None):
        whole = torch.zeros(out.shape[0], out.shape[1] + (0 if out_up is None else out_up.shape[1]), out.shape[2],
                            dtype=torch.float32)
        for e, a, b in _experts(plan):
            tok = plan.token_R[a:b].long()
            pp, qq = (p[tok], q[a:b]) if gather_p else (p[a:b], q[tok])
            whole[e] = pp.float().t() @ qq.float()
        out.copy_(whole[:, :out.shape[1]])
        if out_up is not None:
            out_up.copy_(whole[:, out.shape[1]:])
        return out

    def fp8_rows(self, plan, a_q, w_q, out_dtype, token=None):
        raise AssertionError("refused: tl runs it")


@pytest.fixture
def registered():
    from moeblaze.configs import experts as configs
    before, names = dict(backends._REGISTRY), list(configs._REGISTERED)
    backends.register(TorchStages())
    yield
    backends._REGISTRY.clear()
    backends._REGISTRY.update(before)
    configs._REGISTERED[:] = names
    dispatch.resolve.cache_clear()


@pytest.mark.parametrize("activation,checkpoint", [("swiglu", "preact"), ("gelu", "recompute")])
def test_a_backend_registered_alone_runs_its_stages(registered, activation, checkpoint):
    L, D, H, E, K = 24, 16, 8, 4, 2
    x, w1, w2, idx, w = random_problem(L, D, H, E, K, activation)
    F = w1.shape[1]
    assert F == (2 * H if is_gated(activation) else H)
    ins = [t.clone().requires_grad_() for t in (x, w1, w2, w)]
    launch_counts.clear()
    cfg = ExpertsConfig(activation=activation, checkpoint=checkpoint, backend=NAME)
    out = moe_experts(ins[0], build_routing_index(idx, E), ins[3], ins[1], ins[2], experts=cfg)
    dy = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, ins, dy))
    up = 2 if checkpoint == "recompute" else 1
    assert dict(launch_counts) == {("up", NAME): up, ("down", NAME): 1, ("down_bwd", NAME): 1,
                                   ("weight_grad", NAME): 2, ("dx_rows", "tl"): 1}
    from moeblaze.reference import moe_experts_reference

    def ref(dtype):
        r = [t.to(dtype).requires_grad_() for t in (x, w1, w2, w)]
        o = moe_experts_reference(r[0], idx, r[3], r[1], r[2], experts=ExpertsConfig(activation=activation))
        return (o, *torch.autograd.grad(o, r, dy.to(dtype)))
    for g, same, exact in zip(got, ref(torch.float32), ref(torch.float64)):  # out, dx, dw1, dw2, dtopk_w
        assert_within_torch_error(g, same, exact)


def test_a_backend_without_its_checks_is_refused_and_unknown_names_too():
    class Half(TorchStages):
        takes_weight_grad = None
    with pytest.raises(TypeError, match="takes_weight_grad"):
        backends.register(Half())
    with pytest.raises(ValueError, match="backend must be one of"):
        ExpertsConfig(backend=NAME)
