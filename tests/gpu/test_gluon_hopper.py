"""On a Hopper GPU (`pytest -m gpu`): the Gluon warp-specialised kernels against torch in fp32,
with ragged experts (one empty, one smaller than a tile, one spanning many tiles) and NaN-poisoned output.
RAGGED fits in one tile per program; MANY gives every program several tiles, so both consumers take turns
and the stage ring wraps across tiles."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available()
                                                  or torch.cuda.get_device_capability()[0] != 9, reason="needs sm_90")]


RAGGED = [300, 0, 57, 1000, 128, 1]
MANY = [5000, 0, 3000, 12000, 1, 7000]


# N and K tails: 320 = 2.5 column tiles of 128, 104 = 1.6 K steps of 64
@pytest.mark.parametrize("counts", [RAGGED, MANY], ids=["ragged", "many"])
@pytest.mark.parametrize("N,K", [(256, 192), (320, 104), (1024, 768)])
@pytest.mark.parametrize("variant", ["pingpong", "coop", "handoff", "handoff_kn"])
def test_rows_ws_matches_torch(N, K, counts, variant):
    from moeblaze.kernels.gluon_hopper import rows_handoff, rows_ws
    from moeblaze.ops.experts import tile_schedule

    g = torch.Generator(device="cpu").manual_seed(N + K)
    counts = torch.tensor(counts, dtype=torch.int32)
    E, LK = counts.numel(), int(counts.sum())
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    a = torch.randn(LK, K, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(E, N, K, generator=g) * K ** -0.5).to("cuda", torch.bfloat16)
    counts, offsets = counts.cuda(), offsets.cuda()
    sched = tile_schedule(counts, offsets, LK)
    out = torch.full((LK, N), float("nan"), device="cuda", dtype=a.dtype)
    if variant == "handoff":
        c = rows_handoff(a, w, offsets, sched, out=out)
    elif variant == "handoff_kn":  # W[e] stored (K, N), as W1 is for dX~
        c = rows_handoff(a, w.transpose(1, 2).contiguous(), offsets, sched, out=out, kn=True)
    else:
        c = rows_ws(a, w, offsets, sched, pingpong=variant == "pingpong", out=out)
    ref = torch.cat([a[offsets[e]:offsets[e + 1]].float() @ w[e].float().T for e in range(E)])
    torch_bf16 = torch.cat([a[offsets[e]:offsets[e + 1]] @ w[e].T for e in range(E)])
    assert not c.isnan().any()  # every row written

    def rel(x):
        return float((x.float() - ref).norm() / ref.norm())
    assert rel(c) <= 2 * rel(torch_bf16) + 1e-4, (rel(c), rel(torch_bf16))


@pytest.mark.parametrize("counts", [RAGGED, MANY], ids=["ragged", "many"])
@pytest.mark.parametrize("N,K", [(256, 192), (320, 128), (1024, 768)])
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "coop"])
def test_gathered_rows_ws_matches_torch(N, K, counts, pingpong):
    from moeblaze.kernels.gluon_hopper import gathered_rows_ws
    from moeblaze.ops.experts import tile_schedule

    g = torch.Generator(device="cpu").manual_seed(N * K)
    counts = torch.tensor(counts, dtype=torch.int32)
    E, LK, L = counts.numel(), int(counts.sum()), 700
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    token = torch.randint(0, L, (LK,), generator=g, dtype=torch.int32)
    x = torch.randn(L, K, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(E, N, K, generator=g) * K ** -0.5).to("cuda", torch.bfloat16)
    counts, offsets, token = counts.cuda(), offsets.cuda(), token.cuda()
    sched = tile_schedule(counts, offsets, LK)
    c = gathered_rows_ws(x, w, token, offsets, sched, pingpong=pingpong,
                               out=torch.full((LK, N), float("nan"), device="cuda", dtype=x.dtype))
    xg = x[token.long()]
    ref = torch.cat([xg[offsets[e]:offsets[e + 1]].float() @ w[e].float().T for e in range(E)])
    torch_bf16 = torch.cat([xg[offsets[e]:offsets[e + 1]] @ w[e].T for e in range(E)])
    assert not c.isnan().any()  # every row written

    def rel(t):
        return float((t.float() - ref).norm() / ref.norm())
    assert rel(c) <= 2 * rel(torch_bf16) + 1e-4, (rel(c), rel(torch_bf16))


@pytest.mark.parametrize("counts", [RAGGED, MANY], ids=["ragged", "many"])
@pytest.mark.parametrize("h,d", [(256, 128), (192, 256)])  # 192: one and a half column tiles
def test_up_swiglu_ws_matches_torch(h, d, counts):
    from moeblaze.kernels.gluon_hopper import up_swiglu_ws
    from moeblaze.ops.experts import tile_schedule

    g = torch.Generator(device="cpu").manual_seed(h * d)
    counts = torch.tensor(counts, dtype=torch.int32)
    E, LK, L = counts.numel(), int(counts.sum()), 700
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    token = torch.randint(0, L, (LK,), generator=g, dtype=torch.int32)
    x = torch.randn(L, d, generator=g).to("cuda", torch.bfloat16)
    w1 = (torch.randn(E, 2 * h, d, generator=g) * d ** -0.5).to("cuda", torch.bfloat16)
    counts, offsets, token = counts.cuda(), offsets.cuda(), token.cuda()
    sched = tile_schedule(counts, offsets, LK)
    nan = dict(device="cuda", dtype=x.dtype)
    preact, act = up_swiglu_ws(x, w1, token, offsets, sched, preact=torch.full((LK, 2 * h), float("nan"), **nan),
                               act=torch.full((LK, h), float("nan"), **nan))
    xg = x[token.long()]
    h_ref = torch.cat([xg[offsets[e]:offsets[e + 1]].float() @ w1[e].float().T for e in range(E)])
    h_bf16 = torch.cat([xg[offsets[e]:offsets[e + 1]] @ w1[e].T for e in range(E)])

    def swiglu(t):
        return torch.nn.functional.silu(t[:, :h]) * t[:, h:]
    assert not preact.isnan().any() and not act.isnan().any()  # every row written

    def rel(t, ref):
        return float((t.float() - ref).norm() / ref.norm())
    assert rel(preact, h_ref) <= 2 * rel(h_bf16, h_ref) + 1e-4, (rel(preact, h_ref), rel(h_bf16, h_ref))
    a_ref = swiglu(h_ref)
    assert rel(act, a_ref) <= 2 * rel(swiglu(h_bf16), a_ref) + 1e-4, (rel(act, a_ref), rel(swiglu(h_bf16), a_ref))


