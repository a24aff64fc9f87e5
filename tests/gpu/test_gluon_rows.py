"""On a Hopper GPU (`pytest -m gpu`): the Gluon ping-pong prototype of the row GEMM against torch in fp32,
with ragged experts (one empty, one smaller than a tile, one spanning many tiles) and NaN-poisoned output."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available()
                                                  or torch.cuda.get_device_capability()[0] != 9, reason="needs sm_90")]


# N and K tails: 320 = 2.5 column tiles of 128, 104 = 1.6 K steps of 64
@pytest.mark.parametrize("N,K", [(256, 192), (320, 104), (1024, 768)])
def test_rows_pingpong_matches_torch(N, K):
    from moeblaze.kernels.gluon_rows import rows_pingpong
    from moeblaze.ops.experts import tile_schedule

    g = torch.Generator(device="cpu").manual_seed(N + K)
    counts = torch.tensor([300, 0, 57, 1000, 128, 1], dtype=torch.int32)
    E, LK = counts.numel(), int(counts.sum())
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    a = torch.randn(LK, K, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(E, N, K, generator=g) * K ** -0.5).to("cuda", torch.bfloat16)
    counts, offsets = counts.cuda(), offsets.cuda()
    sched = tile_schedule(counts, offsets, LK)
    c = rows_pingpong(a, w, offsets, sched, out=torch.full((LK, N), float("nan"), device="cuda", dtype=a.dtype))
    ref = torch.cat([a[offsets[e]:offsets[e + 1]].float() @ w[e].float().T for e in range(E)])
    torch_bf16 = torch.cat([a[offsets[e]:offsets[e + 1]] @ w[e].T for e in range(E)])
    assert not c.isnan().any()  # every row written

    def rel(x):
        return float((x.float() - ref).norm() / ref.norm())
    assert rel(c) <= 2 * rel(torch_bf16) + 1e-4, (rel(c), rel(torch_bf16))


@pytest.mark.parametrize("N,K", [(256, 192), (320, 128), (1024, 768)])
def test_gathered_rows_pingpong_matches_torch(N, K):
    from moeblaze.kernels.gluon_rows import gathered_rows_pingpong
    from moeblaze.ops.experts import tile_schedule

    g = torch.Generator(device="cpu").manual_seed(N * K)
    counts = torch.tensor([300, 0, 57, 1000, 128, 1], dtype=torch.int32)
    E, LK, L = counts.numel(), int(counts.sum()), 700
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    token = torch.randint(0, L, (LK,), generator=g, dtype=torch.int32)
    x = torch.randn(L, K, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(E, N, K, generator=g) * K ** -0.5).to("cuda", torch.bfloat16)
    counts, offsets, token = counts.cuda(), offsets.cuda(), token.cuda()
    sched = tile_schedule(counts, offsets, LK)
    c = gathered_rows_pingpong(x, w, token, offsets, sched,
                               out=torch.full((LK, N), float("nan"), device="cuda", dtype=x.dtype))
    xg = x[token.long()]
    ref = torch.cat([xg[offsets[e]:offsets[e + 1]].float() @ w[e].float().T for e in range(E)])
    torch_bf16 = torch.cat([xg[offsets[e]:offsets[e + 1]] @ w[e].T for e in range(E)])
    assert not c.isnan().any()  # every row written

    def rel(t):
        return float((t.float() - ref).norm() / ref.norm())
    assert rel(c) <= 2 * rel(torch_bf16) + 1e-4, (rel(c), rel(torch_bf16))
