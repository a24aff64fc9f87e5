"""The Triton expert kernels under the interpreter, against the fp64 reference, with NaN-poisoned
allocations: output and every gradient (x, w1, w2, router weights)."""
import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze.experts import moe_experts
from moeblaze.experts.tl import TUNED_KERNELS
from moeblaze.experts.tl.configs import pinned
from moeblaze.reference import ACTIVATIONS, moe_experts_reference
from moeblaze.routing import build_routing_index

from helpers import assert_within_torch_error, random_problem, rel_err


def run_both(L, D, H, E, K, activation="swiglu", checkpoint="preact", dtype=torch.float32, skew="uniform"):
    x, w1, w2, idx, w = random_problem(L, D, H, E, K, activation, dtype, skew)
    routing = build_routing_index(idx, E)
    ins = [t.clone().requires_grad_() for t in (x, w1, w2, w)]
    cfg = ExpertsConfig(activation=activation, checkpoint=checkpoint, backend="triton")
    out = moe_experts(ins[0], routing, ins[3], ins[1], ins[2], experts=cfg)
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, ins, dy)
    same, exact = (reference_step((x, w1, w2, w), idx, dy, activation, t) for t in (dtype, torch.float64))
    return list(zip((out,) + grads, same, exact))


def reference_step(inputs, idx, dy, activation, dtype):
    """The PyTorch reference's output and gradients (x, w1, w2, router weights) with everything in dtype."""
    ins = [t.to(dtype).requires_grad_() for t in inputs]
    out = moe_experts_reference(ins[0], idx, ins[3], ins[1], ins[2], experts=ExpertsConfig(activation=activation))
    return (out,) + torch.autograd.grad(out, ins, dy.to(dtype))


def assert_close(triples):
    """Output and every gradient within twice the error of the same computation in torch at their precision
    (helpers.assert_within_torch_error)."""
    for name, (got, same, exact) in zip(("out", "dx", "dw1", "dw2", "dtopk_w"), triples):
        try:
            assert_within_torch_error(got, same, exact)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.parametrize("checkpoint", ["preact", "recompute"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_activation_and_policy(poison_alloc, activation, checkpoint):
    assert_close(run_both(37, 40, 24, 5, 2, activation, checkpoint))


@pytest.mark.parametrize("L,D,H,E,K,skew", [
    (3, 16, 16, 4, 2, "uniform"),  # L smaller than a row tile
    (45, 37, 19, 6, 2, "uniform"),  # odd D and H (masked tiles on every axis)
    (40, 32, 16, 8, 1, "uniform"),  # top-1
    (21, 24, 16, 4, 4, "uniform"),  # K = E
    (50, 32, 24, 8, 2, "empty"),  # half the experts get no tokens: their weight grads must be zeros
    (60, 32, 16, 6, 2, "one"),  # every token to expert 0 (plus one more)
    (64, 48, 40, 13, 3, "uniform"),  # prime E
])
@pytest.mark.parametrize("checkpoint", ["preact", "recompute"])
def test_edge_shapes(poison_alloc, L, D, H, E, K, skew, checkpoint):
    assert_close(run_both(L, D, H, E, K, "swiglu", checkpoint, skew=skew))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_fp16(poison_alloc, activation):
    assert_close(run_both(48, 32, 32, 4, 2, activation, "preact", torch.float16))


def test_all_tokens_to_one_expert_top1(poison_alloc):
    x, w1, w2, _, w = random_problem(33, 16, 16, 4, 1)
    idx = torch.zeros(33, 1, dtype=torch.int32)
    w1.requires_grad_()
    out = moe_experts(x, build_routing_index(idx, 4), w, w1, w2, experts=ExpertsConfig(backend="triton"))
    out.sum().backward()
    same, exact = (moe_experts_reference(x.to(d), idx, w.to(d), w1.detach().to(d), w2.to(d))
                   for d in (torch.float32, torch.float64))
    assert_within_torch_error(out, same, exact)
    assert torch.count_nonzero(w1.grad[1:]) == 0


def test_deterministic(poison_alloc):
    x, w1, w2, idx, w = random_problem(40, 32, 16, 4, 2)
    r = build_routing_index(idx, 4)
    runs = []
    for _ in range(2):
        ins = [t.clone().requires_grad_() for t in (x, w1, w2, w)]
        out = moe_experts(ins[0], r, ins[3], ins[1], ins[2], experts=ExpertsConfig(backend="triton"))
        runs.append((out,) + torch.autograd.grad(out.square().sum(), ins))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: a.update(x=a["x"][:, :-1]), ValueError, "hidden size"),
    (lambda a: a.update(x=a["x"].double()), TypeError, "dtype"),
    (lambda a: a.update(w1=a["w1"][:, :-1]), ValueError, "rows per expert"),
    (lambda a: a.update(w2=a["w2"][:-1]), ValueError, "expert count"),
    (lambda a: a.update(w=a["w"][:-1]), ValueError, "topk_weights shape"),
    (lambda a: a.update(w=a["w"].index_fill(0, torch.tensor([2]), float("nan"))), ValueError, "NaN"),
    (lambda a: a.update(activation="tanh"), ValueError, "activation"),
    (lambda a: a.update(checkpoint="none"), ValueError, "checkpoint"),
    (lambda a: a.update(x=a["x"][:-1]), ValueError, "routing index is for"),
])
def test_bad_inputs_are_rejected(mutate, exc, match):
    x, w1, w2, idx, w = random_problem(8, 16, 8, 4, 2)
    a = dict(x=x, w1=w1, w2=w2, w=w, activation="swiglu", checkpoint="preact")
    mutate(a)
    with pytest.raises(exc, match=match):
        moe_experts(a["x"], build_routing_index(idx, 4), a["w"], a["w1"], a["w2"],
                    experts=ExpertsConfig(activation=a["activation"], checkpoint=a["checkpoint"], backend="triton"))


@pytest.mark.parametrize("checkpoint", ["preact", "recompute"])
def test_token_chunks_give_the_same_result(poison_alloc, checkpoint):
    """Chunked (16 tokens, the last chunk short) and whole: output and every gradient of each run within twice
    torch's own error against fp64. Not bitwise: under the interpreter a row's sums come from numpy's matmul of its
    tile, whose order can depend on the row's place in the tile (OpenBLAS on an AMD EPYC: rows 17-49 differ in the
    last bits), and the chunks place rows differently; dw1 and dw2 are also summed over the chunks in another order."""
    x, w1, w2, idx, w = random_problem(50, 32, 16, 6, 2)
    r = build_routing_index(idx, 6)
    same, exact = (reference_step((x, w1, w2, w), idx, torch.ones(50, 32), "swiglu", t)
                   for t in (torch.float32, torch.float64))
    for chunk in (None, 16):
        ins = [t.clone().requires_grad_() for t in (x, w1, w2, w)]
        cfg = ExpertsConfig(checkpoint=checkpoint, chunk_tokens=chunk, backend="triton")
        out = moe_experts(ins[0], r, ins[3], ins[1], ins[2], experts=cfg)
        run = (out,) + torch.autograd.grad(out, ins, torch.ones_like(out))
        assert_close(zip(run, same, exact))


@pytest.mark.parametrize("block_n,prefetch,split,checkpoint",  # each policy at half the configs, both at each width
                         [(32, 1, 1, "preact"), (32, 0, 1, "recompute"), (64, 0, 2, "recompute"),
                          (64, 1, 2, "preact"), (64, 0, 4, "preact"), (128, 1, 4, "recompute")])
def test_dh_kernel_variants(poison_alloc, monkeypatch, block_n, prefetch, split, checkpoint):
    """Every code path of the dH kernel the GPU autotuner may pick (H prefetch, epilogue in halves or
    quarters, several dS partials per tile), on odd H so the last column tile is masked."""
    cfg = pinned("down_bwd", {"BLOCK_N": block_n, "BLOCK_K": 32, "PREFETCH_H": prefetch, "EPI_SPLIT": split})
    monkeypatch.setattr(TUNED_KERNELS["down_bwd"], "configs", [cfg])
    for activation in ("swiglu", "relu2"):
        assert_close(run_both(37, 40, 72, 5, 2, activation, checkpoint))


@pytest.mark.parametrize("swap", [0, 1])
def test_weight_grad_kernel_variants(poison_alloc, monkeypatch, swap):
    """Every weight-gradient code path the GPU autotuner may pick (swapped operands; the dense side through a
    tensor descriptor where its rows are 16-byte aligned, D = 32 in fp32, through pointers where they are not,
    D = 37), with experts whose row counts are not multiples of the row block."""
    cfg = pinned("weight_grad", {"BLOCK_N": 32, "BLOCK_P": 16, "BLOCK_K": 16, "SWAP": swap})
    monkeypatch.setattr(TUNED_KERNELS["weight_grad"], "configs", [cfg])
    assert_close(run_both(45, 37, 19, 6, 2))
    assert_close(run_both(50, 32, 24, 8, 2, skew="empty"))


@pytest.mark.parametrize("D", [40, 37], ids=["tma", "pointers"])
@pytest.mark.parametrize("two_dots", [0, 1])
def test_up_kernel_variants(poison_alloc, monkeypatch, two_dots, D):
    """Both gated up-projection code paths (one interleaved MMA, or two MMAs whose weights come through a tensor
    descriptor where W1's rows are 16-byte aligned, D = 40 in fp32, and through pointers where they are not,
    D = 37), gated and plain, on a width that leaves the last column tile partial."""
    cfg = pinned("up", {"BLOCK_N": 16, "BLOCK_K": 32, "TWO_DOTS": two_dots})
    monkeypatch.setattr(TUNED_KERNELS["up"], "configs", [cfg])
    for activation in ("swiglu", "gelu"):
        for checkpoint in ("preact", "recompute"):
            assert_close(run_both(37, D, 24, 5, 2, activation, checkpoint))


@pytest.mark.parametrize("persistent", [0, 1])
def test_rows_kernel_variants(poison_alloc, monkeypatch, persistent):
    """The row GEMMs with one program per tile and with persistent programs, including a skewed routing
    whose schedule has many unused tiles."""
    cfg = pinned("rows", {"BLOCK_N": 32, "BLOCK_K": 32, "PERSISTENT": persistent})
    monkeypatch.setattr(TUNED_KERNELS["rows"], "configs", [cfg])
    assert_close(run_both(37, 40, 24, 5, 2))
    assert_close(run_both(60, 32, 16, 6, 2, skew="one"))


@pytest.mark.parametrize("counts,block_m", [([5, 0, 17, 16, 0, 1], 16), ([0, 0, 0, 40], 16), ([3], 4),
                                            ([7] * 40 + [0] * 3, 8), ([0, 0, 0], 16),
                                            ([(e * 37) % 11 for e in range(300)], 4)])
def test_tile_schedule(counts, block_m):
    """Every tile of block_m rows, expert by expert (empty experts own none), with -1 for the unused
    tail up to the bound L·K // block_m + E; the used count; many experts spill over several programs."""
    from moeblaze.experts.schedule import tile_schedule

    counts = torch.tensor(counts, dtype=torch.int32)
    offsets = torch.nn.functional.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))
    rows = int(counts.sum())
    want = [(e, int(offsets[e]) + j * block_m) for e in range(len(counts))
            for j in range(-(-int(counts[e]) // block_m))]
    bound = rows // block_m + len(counts)
    tile_expert, tile_row, used = tile_schedule(counts, offsets, rows, block_m)
    assert tile_expert.shape == tile_row.shape == (bound,) and tile_expert.dtype == tile_row.dtype == torch.int32
    assert list(zip(tile_expert.tolist(), tile_row.tolist()))[:len(want)] == want
    assert tile_expert[len(want):].tolist() == [-1] * (bound - len(want))
    assert used.tolist() == [len(want)]


def test_gluon_kernels_import_and_are_never_chosen_off_hopper():
    """The Gluon kernels' modules resolve their TMA and cp.async names on this triton (3.6 and 3.9 name them
    differently); off an sm_90 GPU "auto" resolves to tl, "gluon" is refused with a message naming what it
    needs, and an unknown backend is refused too."""
    from moeblaze.experts import dispatch
    from moeblaze.experts.gluon_sm90 import common

    assert callable(common.tma_load) and callable(common.cp_async)
    cpu = torch.device("cpu")
    assert dispatch.resolve("auto", cpu) == dispatch.resolve("tl", cpu) == "tl"
    with pytest.raises(ValueError, match="sm_90"):
        dispatch.resolve("gluon", cpu)
    x, w1, w2, idx, w = random_problem(8, 16, 8, 4, 2)
    with pytest.raises(ValueError, match="backend must be one of"):
        moe_experts(x, build_routing_index(idx, 4), w, w1, w2, experts=ExpertsConfig(backend="cuda"))
    with pytest.raises(ValueError, match="sm_90"):
        moe_experts(x, build_routing_index(idx, 4), w, w1, w2, experts=ExpertsConfig(backend="gluon"))


def test_launch_counts_name_the_backend_of_every_stage():
    """experts.dispatch counts every launch decision: on the CPU each GEMM stage of a step runs on tl."""
    from moeblaze.experts import launch_counts

    x, w1, w2, idx, w = random_problem(16, 16, 8, 4, 2)
    launch_counts.clear()
    out = moe_experts(x, build_routing_index(idx, 4), w.requires_grad_(), w1.requires_grad_(), w2,
                      experts=ExpertsConfig(backend="triton"))
    out.sum().backward()
    assert dict(launch_counts) == {("up", "tl"): 1, ("down", "tl"): 1, ("down_bwd", "tl"): 1,
                                   ("weight_grad", "tl"): 2, ("dx_rows", "tl"): 1}


@pytest.mark.parametrize("in_place", [False, True], ids=["apart", "in_place"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_act_bwd_kernel_matches_autograd(poison_alloc, activation, in_place):
    """The dH epilogue as its own pass (the Hopper path's, after dA' = dy[token] @ W2[e]): dH, s·A and dS
    against autograd through the reference activation in fp64, on ragged shapes (rows and H not multiples
    of the blocks); in place, s·A over dA' and dH over H, as the layer runs it. Each row's router weight
    is found through the routing index and its dS lands at its (token, k) in the router-weight gradient."""
    from moeblaze.experts import stages
    from moeblaze.reference import apply_activation, up_width

    g = torch.Generator().manual_seed(7)
    L, K, E, H = 9, 3, 4, 37
    LK = L * K
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(L)]).to(torch.int32)
    routing = build_routing_index(idx, E)
    slot = routing.token_slot
    topk_w = torch.rand(L, K, generator=g) + 0.5
    s = torch.empty(LK)
    s[slot.reshape(-1).long()] = topk_w.reshape(-1)  # each row's router weight, in row order
    preact = torch.randn(LK, up_width(activation, H), generator=g)
    dact = torch.randn(LK, H, generator=g)
    h64 = preact.double().requires_grad_()
    a = apply_activation(h64, activation)
    (dh_ref,) = torch.autograd.grad(a, h64, dact.double() * s.double()[:, None])
    sa_ref, ds_ref = a.detach() * s.double()[:, None], (dact.double() * a.detach()).sum(1)
    d_in, p_in = dact.clone(), preact.clone()
    dpreact = p_in if in_place else torch.empty_like(preact)
    act_scaled = d_in if in_place else torch.empty_like(dact)
    dtopk_w = stages.act_bwd(stages.RowPlan.build(routing), d_in, p_in, topk_w, dpreact, act_scaled, activation)
    assert dtopk_w.shape == (L, K) and dtopk_w.dtype == topk_w.dtype
    for name, ours, ref in (("dH", dpreact, dh_ref), ("s·A", act_scaled, sa_ref), ("dS", dtopk_w, ds_ref[slot.long()])):
        # fp32 against fp64: each value a few roundings (SiLU's exp and division, two products; dS a 16-term sum)
        assert rel_err(ours, ref) <= 1e-6, (name, rel_err(ours, ref))


def test_act_bwd_kernel_leaves_rows_no_pair_names(poison_alloc):
    """A rounded routing's static row buffer has rows no pair names (its tail, token 0 in expert_token_idx) holding
    whatever was there: the pass must store no dS from them (it once stored a NaN over token 0's first pair's dS, on
    Hopper only, where this pass runs), and every named row's dS is still right."""
    from moeblaze.experts import stages
    from moeblaze.routing.rounding import rounded_index

    g = torch.Generator().manual_seed(8)
    L, E, H = 12, 4, 16
    kept = torch.rand(L, E, generator=g) < 0.5
    kept[0, 0] = True
    weights = torch.rand(L, E, generator=g) + 0.5
    index, wk, over = rounded_index(kept, weights, E, L * E + 5)  # 5 + L·E - pairs rows no pair names
    assert not over
    R, n = index.expert_token_idx.shape[0], int(kept.sum())
    preact, dact = torch.randn(R, 2 * H, generator=g), torch.randn(R, H, generator=g)
    preact[n:], dact[n:] = float("nan"), float("nan")
    dtopk_w = stages.act_bwd(stages.RowPlan.build(index), dact.clone(), preact.clone(), wk, torch.empty_like(preact),
                             torch.empty_like(dact), "swiglu")
    from moeblaze.reference import apply_activation
    a = apply_activation(preact.double(), "swiglu")
    ds_rows = (dact.double() * a).sum(1)
    named = index.token_slot < n
    assert torch.isfinite(dtopk_w[named]).all()
    # fp32 against fp64: a 16-term sum of products of a few roundings each, within 8 ulps (2^-23) norm-wise
    assert rel_err(dtopk_w[named], ds_rows[index.token_slot[named].long()]) <= 1e-6
