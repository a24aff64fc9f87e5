"""On a Hopper GPU (`pytest -m gpu`): the Gluon warp-specialised kernels launched directly against torch in
fp32, with ragged experts (one empty, one smaller than a tile, one spanning many tiles) and NaN-poisoned output.
RAGGED fits in one tile per program; MANY gives every program several tiles, so the stage ring wraps across
tiles and the hand-off alternates."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available()
                                                  or torch.cuda.get_device_capability()[0] != 9, reason="needs sm_90")]


RAGGED = [300, 0, 57, 1000, 128, 1]
MANY = [5000, 0, 3000, 12000, 1, 7000]
TOKENS = 700  # rows of x for the gathering kernels


def routing(counts, g, gathered):
    """(E, LK, offsets, token, tile schedule) on the GPU for these per-expert row counts; token (each row's
    token, drawn from g) only where gathered."""
    from moeblaze.experts.schedule import tile_schedule

    counts = torch.tensor(counts, dtype=torch.int32)
    E, LK = counts.numel(), int(counts.sum())
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    token = torch.randint(0, TOKENS, (LK,), generator=g, dtype=torch.int32).cuda() if gathered else None
    counts, offsets = counts.cuda(), offsets.cuda()
    return E, LK, offsets, token, tile_schedule(counts, offsets, LK)


def per_expert(a, w, offsets, exact):
    """a[rows of e] @ w[e]ᵀ for every expert: in fp32 if exact, else torch's own bf16 matmul."""
    parts = [a[offsets[e]:offsets[e + 1]] for e in range(w.shape[0])]
    if exact:
        return torch.cat([p.float() @ w[e].float().T for e, p in enumerate(parts)])
    return torch.cat([p @ w[e].T for e, p in enumerate(parts)])


def assert_within_torch_error(ours, ref, torch_bf16):
    """Our error against the fp32 reference is at most twice torch's own bf16 error (+1e-4)."""
    def rel(t):
        return float((t.float() - ref).norm() / ref.norm())
    assert rel(ours) <= 2 * rel(torch_bf16) + 1e-4, (rel(ours), rel(torch_bf16))


# N and K tails: 320 = 2.5 column tiles of 128, 104 = 1.6 K steps of 64
@pytest.mark.parametrize("counts", [RAGGED, MANY], ids=["ragged", "many"])
@pytest.mark.parametrize("N,K", [(256, 192), (320, 104), (1024, 768)])
@pytest.mark.parametrize("kn", [False, True], ids=["nk", "kn"])
def test_rows_gemm_matches_torch(N, K, counts, kn):
    """C = A[rows] @ W[e]ᵀ with W[e] stored (N, K) (the down-projection) or (K, N) (dX~)."""
    from moeblaze.experts.gluon_sm90 import rows_gemm

    g = torch.Generator(device="cpu").manual_seed(N + K)
    E, LK, offsets, _, sched = routing(counts, g, gathered=False)
    a = torch.randn(LK, K, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(E, N, K, generator=g) * K ** -0.5).to("cuda", torch.bfloat16)
    out = torch.full((LK, N), float("nan"), device="cuda", dtype=a.dtype)
    c = rows_gemm(a, w.transpose(1, 2).contiguous() if kn else w, offsets, sched, out=out, kn=kn)
    assert not c.isnan().any()  # every row written
    assert_within_torch_error(c, per_expert(a, w, offsets, True), per_expert(a, w, offsets, False))


@pytest.mark.parametrize("counts", [RAGGED, MANY], ids=["ragged", "many"])
@pytest.mark.parametrize("N,K", [(256, 192), (328, 128), (1024, 768)])  # 328: a column tail of 72
def test_gathered_rows_gemm_matches_torch(N, K, counts):
    """dA' = dy[token] @ W2[e] with W2[e] stored (K, N)."""
    from moeblaze.experts.gluon_sm90 import gathered_rows_gemm

    g = torch.Generator(device="cpu").manual_seed(N + 3 * K)
    E, LK, offsets, token, sched = routing(counts, g, gathered=True)
    x = torch.randn(TOKENS, K, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(E, K, N, generator=g) * K ** -0.5).to("cuda", torch.bfloat16)
    c = gathered_rows_gemm(x, w, token, offsets, sched, out=torch.full((LK, N), float("nan"), device="cuda",
                                                                       dtype=x.dtype))
    xg, wt = x[token.long()], w.transpose(1, 2)
    assert not c.isnan().any()  # every row written
    assert_within_torch_error(c, per_expert(xg, wt, offsets, True), per_expert(xg, wt, offsets, False))


@pytest.mark.parametrize("counts", [RAGGED, MANY], ids=["ragged", "many"])
@pytest.mark.parametrize("h,d", [(256, 128), (200, 256)])  # 200: a gate tile reaching into the next expert's rows
def test_up_swiglu_reads_w1_in_two_parts_as_whole(h, d, counts):
    """W1 as (gate rows, up rows), torchtitan's w1 and w3, read in place through two descriptors: H and A bitwise
    those of the concatenated W1 (the same tiles, loaded from two tensors)."""
    from moeblaze.experts.gluon_sm90 import up_swiglu

    g = torch.Generator(device="cpu").manual_seed(h + d)
    E, LK, offsets, token, sched = routing(counts, g, gathered=True)
    x = torch.randn(TOKENS, d, generator=g).to("cuda", torch.bfloat16)
    gate, up = ((torch.randn(E, h, d, generator=g) * d ** -0.5).to("cuda", torch.bfloat16) for _ in range(2))
    nan = dict(device="cuda", dtype=x.dtype)
    want = up_swiglu(x, torch.cat((gate, up), 1), token, offsets, sched)
    got = up_swiglu(x, gate, token, offsets, sched, w1_up=up, preact=torch.full((LK, 2 * h), float("nan"), **nan),
                    act=torch.full((LK, h), float("nan"), **nan))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("counts", [RAGGED, MANY], ids=["ragged", "many"])
@pytest.mark.parametrize("h,d", [(256, 320), (192, 256)])  # 320: a column tail; 192: three K steps per part
def test_rows_gemm_reads_w1_in_two_parts_as_whole(h, d, counts):
    """dX~ = dH @ W1[e] with W1's gate and up rows as two tensors, the K loop switching descriptors at h: bitwise
    the concatenated W1's (the same boxes, loaded from two tensors)."""
    from moeblaze.experts.gluon_sm90 import rows_gemm

    g = torch.Generator(device="cpu").manual_seed(h * 7 + d)
    E, LK, offsets, _, sched = routing(counts, g, gathered=False)
    dh = torch.randn(LK, 2 * h, generator=g).to("cuda", torch.bfloat16)
    gate, up = ((torch.randn(E, h, d, generator=g) * h ** -0.5).to("cuda", torch.bfloat16) for _ in range(2))
    want = rows_gemm(dh, torch.cat((gate, up), 1), offsets, sched, kn=True)
    got = rows_gemm(dh, gate, offsets, sched, kn=True, w_up=up,
                    out=torch.full((LK, d), float("nan"), device="cuda", dtype=dh.dtype))
    assert torch.equal(got, want)


@pytest.mark.parametrize("counts", [RAGGED, MANY], ids=["ragged", "many"])
@pytest.mark.parametrize("h,d", [(128, 256), (384, 512)])
def test_weight_grad_stores_dw1_in_two_parts_as_whole(h, d, counts):
    """dW1 = dHᵀ x[token] stored as gate rows and up rows in two tensors (each tile into its part): bitwise the
    whole dW1's halves, every element written."""
    from moeblaze.experts.gluon_sm90 import weight_grad

    g = torch.Generator(device="cpu").manual_seed(h + 11 * d)
    E, LK, offsets, token, _ = routing(counts, g, gathered=True)
    dh = torch.randn(LK, 2 * h, generator=g).to("cuda", torch.bfloat16)
    x = torch.randn(TOKENS, d, generator=g).to("cuda", torch.bfloat16)
    whole = weight_grad(dh, x, token, offsets, torch.empty(E, 2 * h, d, device="cuda", dtype=x.dtype), False)
    gate, up = (torch.full((E, h, d), float("nan"), device="cuda", dtype=x.dtype) for _ in range(2))
    weight_grad(dh, x, token, offsets, gate, False, out_up=up)
    assert torch.equal(gate, whole[:, :h]) and torch.equal(up, whole[:, h:])


@pytest.mark.parametrize("counts", [RAGGED, MANY, [0, 0, 64, 0]], ids=["ragged", "many", "one_stage"])
@pytest.mark.parametrize("gather_p,M,N,parts", [(False, 256, 512, True), (False, 328, 512, False),
                                                 (True, 256, 200, False), (True, 384, 768, False)],
                         ids=["dW1-in-parts", "dW1", "dW2", "dW2_wide"])
def test_weight_grad_in_float32_is_the_bf16_kernels_sums(counts, gather_p, M, N, parts):
    """A float32 dW (master weights' gradients), stored from the registers: the same fp32 sums the bf16 kernel
    rounds, so rounded to bf16 it is that kernel's dW bit for bit, every element written (W1's two parts too)."""
    from moeblaze.experts.gluon_sm90 import weight_grad

    g = torch.Generator(device="cpu").manual_seed(M * N + len(counts) + parts)
    E, LK, offsets, token, _ = routing(counts, g, gathered=True)
    p = torch.randn(TOKENS if gather_p else LK, M, generator=g).to("cuda", torch.bfloat16)
    q = torch.randn(LK if gather_p else TOKENS, N, generator=g).to("cuda", torch.bfloat16)
    want = weight_grad(p, q, token, offsets, torch.empty(E, M, N, device="cuda", dtype=torch.bfloat16), gather_p)
    nan = dict(device="cuda", dtype=torch.float32)
    if parts:
        gate, up = torch.full((E, M // 2, N), float("nan"), **nan), torch.full((E, M // 2, N), float("nan"), **nan)
        weight_grad(p, q, token, offsets, gate, gather_p, out_up=up)
        got = torch.cat((gate, up), 1)
    else:
        got = weight_grad(p, q, token, offsets, torch.full((E, M, N), float("nan"), **nan), gather_p)
    assert not got.isnan().any()
    assert torch.equal(got.to(torch.bfloat16), want)


@pytest.mark.parametrize("counts", [RAGGED, MANY], ids=["ragged", "many"])
@pytest.mark.parametrize("h,d", [(256, 128), (192, 256)])  # 192: one and a half column tiles
@pytest.mark.parametrize("store_act", [True, False], ids=["H_and_A", "H_only"])
def test_up_swiglu_matches_torch(h, d, counts, store_act):
    from moeblaze.experts.gluon_sm90 import up_swiglu

    g = torch.Generator(device="cpu").manual_seed(h * d)
    E, LK, offsets, token, sched = routing(counts, g, gathered=True)
    x = torch.randn(TOKENS, d, generator=g).to("cuda", torch.bfloat16)
    w1 = (torch.randn(E, 2 * h, d, generator=g) * d ** -0.5).to("cuda", torch.bfloat16)
    nan = dict(device="cuda", dtype=x.dtype)
    preact, act = up_swiglu(x, w1, token, offsets, sched, preact=torch.full((LK, 2 * h), float("nan"), **nan),
                               act=torch.full((LK, h), float("nan"), **nan) if store_act else None,
                               store_act=store_act)
    xg = x[token.long()]
    h_ref, h_bf16 = per_expert(xg, w1, offsets, True), per_expert(xg, w1, offsets, False)

    def swiglu(t):
        return torch.nn.functional.silu(t[:, :h]) * t[:, h:]
    assert not preact.isnan().any()  # every row written
    assert_within_torch_error(preact, h_ref, h_bf16)
    if store_act:
        assert not act.isnan().any()
        assert_within_torch_error(act, swiglu(h_ref), swiglu(h_bf16))
    else:
        assert act is None


# dW1: P = dH (dense, 328 columns: 2.6 row tiles of dW, stored piecewise), Q = x[token] (512 = 2 column tiles);
# dW2: P = dy[token] (256 = 2 row tiles, stored by TMA), Q = s·A (dense, 200 columns: a column tail)
@pytest.mark.parametrize("counts", [RAGGED, MANY, [0, 0, 64, 0]], ids=["ragged", "many", "one_stage"])
@pytest.mark.parametrize("gather_p,M,N", [(False, 328, 512), (True, 256, 200), (True, 384, 768)],
                         ids=["dW1", "dW2", "dW2_wide"])
def test_weight_grad_matches_torch(counts, gather_p, M, N):
    """dW[e] = P[rows]ᵀ Q[rows] with one side gathered; experts without rows get zeros."""
    from moeblaze.experts.gluon_sm90 import weight_grad

    g = torch.Generator(device="cpu").manual_seed(M * N + len(counts))
    E, LK, offsets, token, _ = routing(counts, g, gathered=True)
    p = torch.randn(TOKENS if gather_p else LK, M, generator=g).to("cuda", torch.bfloat16)
    q = torch.randn(LK if gather_p else TOKENS, N, generator=g).to("cuda", torch.bfloat16)
    out = torch.full((E, M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    weight_grad(p, q, token, offsets, out, gather_p)
    pm = p[token.long()] if gather_p else p
    qm = q if gather_p else q[token.long()]
    rows = [slice(int(offsets[e]), int(offsets[e + 1])) for e in range(E)]
    ref = torch.stack([pm[r].float().T @ qm[r].float() for r in rows])
    assert not out.isnan().any()  # every element written
    empty = torch.tensor(counts) == 0
    assert (out[empty.cuda()] == 0).all()
    assert_within_torch_error(out, ref, torch.stack([pm[r].T @ qm[r] for r in rows]))
