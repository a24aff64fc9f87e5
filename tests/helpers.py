"""Random MoE problems for tests (fresh random inputs, never zeros) and the routing index's invariants."""
import torch

from moeblaze.reference import up_width
from moeblaze.routing import RoutingIndex


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def random_routing(L: int, E: int, K: int, skew: str = "uniform", gen=None) -> torch.Tensor:
    """(L, K) int32 distinct expert ids per token. skew: "uniform", "one" (every token's first choice
    is expert 0), or "empty" (experts E//2.. never chosen when K <= E//2)."""
    if skew == "one":
        rest = torch.stack([torch.randperm(E - 1, generator=gen)[: K - 1] + 1 for _ in range(L)]) if K > 1 else None
        first = torch.zeros(L, 1, dtype=torch.long)
        return (first if rest is None else torch.cat([first, rest], 1)).int()
    pool = E // 2 if skew == "empty" else E
    return torch.stack([torch.randperm(pool, generator=gen)[:K] for _ in range(L)]).int()


def random_problem(L, D, H, E, K, activation="swiglu", dtype=torch.float32, skew="uniform", device="cpu"):
    x = torch.randn(L, D, dtype=dtype, device=device)
    w1 = torch.randn(E, up_width(activation, H), D, dtype=dtype, device=device) / D ** 0.5
    w2 = torch.randn(E, D, H, dtype=dtype, device=device) / H ** 0.5
    idx = random_routing(L, E, K, skew).to(device)
    w = torch.rand(L, K, device=device) + 0.1
    return x, w1, w2, idx, w


def check_invariants(r: RoutingIndex, idx: torch.Tensor) -> None:
    L, K = idx.shape
    E = r.num_experts
    for t in r.tensors():
        assert t.dtype == torch.int32
    assert r.expert_token_idx.shape == (L * K,) and r.token_slot.shape == (L, K) and r.expert_offsets.shape == (E + 1,)
    assert r.expert_offsets[0] == 0 and r.expert_offsets[-1] == L * K
    assert torch.equal(r.expert_offsets[1:], r.expert_counts.cumsum(0).int())
    assert torch.equal(r.expert_counts, torch.bincount(idx.flatten().long(), minlength=E).int())
    # token_slot inverts expert_token_idx and lands in the right expert's segment
    tokens = torch.arange(L).repeat_interleave(K)
    assert torch.equal(r.expert_token_idx[r.token_slot.flatten().long()].long(), tokens)
    assert torch.equal(torch.sort(r.token_slot.flatten()).values, torch.arange(L * K, dtype=torch.int32))
    assert torch.equal(r.topk_idx(), idx.int())
    for e in range(E):  # tokens ascend inside each expert
        seg = r.expert_token_idx[r.expert_offsets[e]: r.expert_offsets[e + 1]]
        assert torch.all(seg[1:] > seg[:-1])


def _rank_entry(rank, world, port, body, args, errors):
    import os

    import torch.distributed as dist

    patch_builtins_by_name()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        body(rank, world, errors, *args)
        dist.barrier()  # every rank's collectives done before any rank tears the group down
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now, for a process group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(body, world: int, *args) -> None:
    """Run body(rank, world, errors, *args) in `world` spawned CPU processes of one gloo group on 127.0.0.1; body
    puts what it finds wrong on `errors` (a queue), and the caller's test fails listing every rank's findings (an
    exception in a rank fails it too)."""
    import torch.multiprocessing as mp

    port = free_port()
    errors = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank_entry, args=(world, port, body, args, errors), nprocs=world, join=True,
                       start_method="spawn")
    bad = []
    while not errors.empty():
        bad.append(errors.get())
    assert not bad, bad


def patch_builtins_by_name():
    """Triton's interpreter (3.6 to 3.9) patches triton.language's builtins on every call of a jit function, the
    kernel's helpers included, and finds them each time by inspect.getmembers over the whole module: a third of the
    interpreted kernels' time on this suite. The same patching by a list of the builtins' names, made once from the
    untouched modules; which attributes get patched, and how, is unchanged (a name is patched where it still holds a
    builtin, as inspect.getmembers would have found it). Only under the interpreter (TRITON_INTERPRET=1)."""
    import inspect
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if original is None or patch_attr is None or getattr(original, "by_name", False):
        return  # another Triton (its own patching runs), or done already
    is_builtin, names = interpreter.tl.core.is_builtin, {}

    def patch_builtin(pkg, builder, scope):
        if pkg not in names:
            names[pkg] = [name for name, member in inspect.getmembers(pkg) if is_builtin(member)]
        for name in names[pkg]:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    patch_builtin.by_name = True
    interpreter._patch_builtin = patch_builtin
