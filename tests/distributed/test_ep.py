"""Expert parallelism on CPU processes (gloo, 127.0.0.1): the receiver index's order, and the EP layer at 2 and 4
ranks against one process over all ranks' tokens, bitwise (torch.equal) on the Triton kernels under the
interpreter (fp32): output, dx, the router weights' gradient and each rank's expert-weight gradients, under both
checkpoint policies, with skewed routing, empty experts, a rank without tokens and a rank that receives nothing."""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeblaze.distributed import ep_experts, receiver_index
from moeblaze.experts import moe_experts
from moeblaze.routing import build_routing_index

from helpers import random_problem, random_routing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, cases, errors):
    """Every (case, checkpoint) in one process group: spawning and importing cost more than the cases."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case, checkpoint in cases:
            try:
                _compare(rank, world, case, checkpoint)
            except AssertionError as e:  # reported to the parent, which fails the test; the ranks go on together
                errors.put(f"rank {rank}, {case}, {checkpoint}: {e}")
    finally:
        dist.destroy_process_group()


def _problem(world, case):
    """Every rank's tokens (a list of (x, idx, w)) and the weights of all E experts; the same on every rank."""
    torch.manual_seed(7)
    E, D, H, K = 2 * world, 16, 16, 2
    sizes = [9 + 4 * r for r in range(world)]
    if case == "empty_rank":
        sizes[-1] = 0
    _, w1, w2, _, _ = random_problem(1, D, H, E, K)
    toks = []
    for L in sizes:
        if L == 0:
            toks.append((torch.randn(0, D), torch.zeros(0, K, dtype=torch.int32), torch.rand(0, K)))
            continue
        x, _, _, idx, w = random_problem(L, D, H, E, K)
        if case == "skewed":  # every token to the first rank's experts: the others receive nothing
            idx = random_routing(L, 2, K)
        elif case == "empty_experts":  # experts 1 and E - 1 never chosen
            pool = torch.tensor([e for e in range(E) if e not in (1, E - 1)])
            idx = torch.stack([pool[torch.randperm(len(pool))[:K]] for _ in range(L)]).int()
        toks.append((x, idx.int(), w))
    return toks, w1, w2


def _compare(rank, world, case, checkpoint):
    toks, w1, w2 = _problem(world, case)
    E_loc = w1.shape[0] // world
    # one process over all ranks' tokens
    x_all, idx_all, w_all = (torch.cat([t[i] for t in toks]) for i in range(3))
    ins = [t.clone().requires_grad_() for t in (x_all, w_all, w1, w2)]
    out_all = moe_experts(ins[0], build_routing_index(idx_all, w1.shape[0]), ins[1], ins[2], ins[3],
                          checkpoint=checkpoint, impl="triton")
    dy_all = torch.randn(out_all.shape, generator=torch.Generator().manual_seed(3))
    g_all = torch.autograd.grad(out_all, ins, dy_all)
    # this rank's share under expert parallelism
    lo = sum(len(t[0]) for t in toks[:rank])
    mine = slice(lo, lo + len(toks[rank][0]))
    experts = slice(rank * E_loc, (rank + 1) * E_loc)
    x, idx, w = toks[rank]
    local = [x.clone().requires_grad_(), w.clone().requires_grad_(), w1[experts].clone().requires_grad_(),
             w2[experts].clone().requires_grad_()]
    out = ep_experts(local[0], idx, local[1], local[2], local[3], checkpoint=checkpoint)
    g = torch.autograd.grad(out, local, dy_all[mine])
    assert torch.equal(out, out_all[mine]), "out"
    for name, a, b in zip(("dx", "dtopk_w"), g[:2], (g_all[0][mine], g_all[1][mine])):
        assert torch.equal(a, b), name
    for name, a, b in zip(("dw1", "dw2"), g[2:], (g_all[2][experts], g_all[3][experts])):
        assert torch.equal(a, b), name


def _run(world, cases):
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, _free_port(), cases, errors), nprocs=world, join=True,
                       start_method="spawn")
    bad = []
    while not errors.empty():
        bad.append(errors.get())
    assert not bad, bad


def test_ep2_equals_one_process_bitwise():
    _run(2, [(case, checkpoint) for case in ("uniform", "skewed", "empty_experts", "empty_rank")
             for checkpoint in ("preact", "recompute")])


def test_ep4_equals_one_process_bitwise():
    _run(4, [("empty_experts", "recompute"), ("empty_rank", "preact")])


def test_receiver_index_orders_rows_by_expert_then_source():
    counts = torch.tensor([[2, 0, 1], [0, 0, 3], [1, 0, 0]], dtype=torch.int32)  # (source, local expert)
    r = receiver_index(counts)
    # rows arrive: source 0: e0 e0 e2 | source 1: e2 e2 e2 | source 2: e0
    assert r.expert_counts.tolist() == [3, 0, 4] and r.expert_offsets.tolist() == [0, 3, 3, 7]
    assert r.expert_token_idx.tolist() == [0, 1, 6, 2, 3, 4, 5]
    assert torch.equal(r.expert_token_idx[r.token_slot[:, 0].long()], torch.arange(7, dtype=torch.int32))
    empty = receiver_index(torch.zeros(2, 3, dtype=torch.int32))
    assert empty.expert_token_idx.numel() == 0 and empty.expert_offsets.tolist() == [0, 0, 0, 0]
