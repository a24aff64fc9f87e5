"""Random MoE problems for tests (fresh random inputs, never zeros) and the routing index's invariants."""
import contextlib

import torch

from moeblaze.reference import up_width
from moeblaze.routing import RoutingIndex


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_within_torch_error(got: torch.Tensor, torch_same: torch.Tensor, exact: torch.Tensor, factor: float = 2):
    """got's relative error against the exact (fp64) result is at most `factor` times the error of the same
    computation in torch at got's precision (torch_same), plus two of that precision's machine epsilons, the
    closest two valid orders of the same sums are sure to agree (flash-attention's rule). The reference's error is
    measured here, on this machine, so the bound moves with its rounding and never with a constant fit to one CPU."""
    assert torch.isfinite(got).all()
    bound = factor * rel_err(torch_same, exact) + 2 * torch.finfo(got.dtype).eps
    assert rel_err(got, exact) <= bound, (rel_err(got, exact), rel_err(torch_same, exact))


# The fp8 kernels against the reference's emulation of the same recipe, both fp32: the same e4m3 operands, the fp32
# sums in another order (a few ulps, 2^-23 each); a value that order moves across an e4m3 rounding boundary (odds
# about 2^-23 / 2^-4 per value) rounds one step, 2^-3 of it, the other way. A few such steps among the thousands of
# values of these problems stay below 1e-3 of a norm; a wrong operand, scale or row errs by e4m3's own 2-8%.
FP8_VS_EMULATION = 1e-3

# Routing weights of two implementations of one rule (a rounded index against its torch path, a layer against its
# parts), fp32 both ways: a top-k renormalisation's few roundings in another order, within 8 ulps (2^-23 each).
ROUTING_WEIGHTS_RTOL = 1e-6
# The logits' gradient through those weights, the same fp32 backward through inputs 8 ulps apart: a norm-wise 1e-5
# is 80 ulps of it.
ROUTING_GRAD_RTOL = 1e-5


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


def rank_problems(sizes, E, D, H, K, seed, route=None):
    """Expert-parallel test problems: each rank's (x, idx, w) for its token count in sizes (0: an empty rank) and
    the weights of all E experts, the same on every rank (seeded). route(L), where given, chooses a rank's expert ids
    in place of a uniform routing."""
    torch.manual_seed(seed)
    _, w1, w2, _, _ = random_problem(1, D, H, E, K)
    toks = []
    for L in sizes:
        if L == 0:
            toks.append((torch.randn(0, D), torch.zeros(0, K, dtype=torch.int32), torch.rand(0, K)))
            continue
        x, _, _, idx, w = random_problem(L, D, H, E, K)
        toks.append((x, (idx if route is None else route(L)).int(), w))
    return toks, w1, w2


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


class _Found(list):
    """What a rank's body finds wrong (its errors.put), sent back with the rank's result."""

    put = list.append


def _rank_loop(rank, world, jobs, results):
    """One rank of a pool: runs each job's body in a fresh gloo group, reports (rank, findings, traceback or None)."""
    import os
    import traceback

    import torch.distributed as dist

    speed_up_triton_interpreter()
    while (job := jobs.get()) is not None:
        port, body, args = job
        found, failure = _Found(), None
        try:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=world)
            try:
                body(rank, world, found, *args)
                dist.barrier()  # every rank's collectives done before any rank tears the group down
            finally:
                dist.destroy_process_group()
        except BaseException:
            failure = traceback.format_exc()
        results.put((rank, list(found), failure))


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now, for a process group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_POOLS: dict = {}  # world -> (processes, their job queues, the results queue)


# What the fork server imports once, before the processes the tests start from it are forked: a spawned process
# took ~5 CPU-seconds importing these, and the suite starts ~30 ranks and ~15 snippets.
PRELOAD = ["helpers", "torch", "torch.distributed", "triton", "moeblaze.experts", "moeblaze.distributed"]


def preloaded_processes():
    """multiprocessing's fork-server context, its server (one per test process, started at first use: a fresh
    interpreter, so no test's state reaches it) having imported PRELOAD; a process started from it imports the
    module of the function it runs, where it first unpickles it."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _pool(world: int):
    """This test process's `world` ranks (preloaded_processes), started at first use and kept."""
    pool = _POOLS.get(world)
    if pool is None or not all(p.is_alive() for p in pool[0]):
        if pool is not None:
            _close(world)
        ctx = preloaded_processes()
        jobs, results = [ctx.SimpleQueue() for _ in range(world)], ctx.Queue()
        procs = [ctx.Process(target=_rank_loop, args=(r, world, jobs[r], results), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        pool = _POOLS[world] = (procs, jobs, results)
    return pool


def _close(world: int) -> None:
    procs, _, _ = _POOLS.pop(world)
    for p in procs:
        p.kill()
        p.join()


def close_pools() -> None:
    """Stop every pool's ranks (conftest calls this at the end of each test process's session)."""
    for world in list(_POOLS):
        _close(world)


def run_ranks(body, world: int, *args, timeout_s: float = 600) -> None:
    """Run body(rank, world, errors, *args) in `world` CPU processes of one gloo group on 127.0.0.1 (a pool of
    spawned processes that stays for the next call; a fresh group each call); body puts what it finds wrong on
    `errors`, and the caller's test fails listing every rank's findings. An exception in a rank fails the test
    with its traceback, and the pool is replaced (the other ranks may wait in a collective)."""
    import queue
    import time

    procs, jobs, results = _pool(world)
    port = free_port()
    for q in jobs:
        q.put((port, body, args))
    bad, done, deadline = [], 0, time.monotonic() + timeout_s
    while done < world:
        try:
            rank, found, failure = results.get(timeout=1)
        except queue.Empty:
            alive = all(p.is_alive() for p in procs)
            if time.monotonic() > deadline or not alive:
                _close(world)
                raise AssertionError(f"ranks {'timed out' if alive else 'died'}; found so far: {bad}") from None
            continue
        done += 1
        bad += found
        if failure is not None:
            _close(world)
            raise AssertionError(f"rank {rank} raised:\n{failure}\nfound so far: {bad}")
    assert not bad, bad


def speed_up_triton_interpreter():
    """Work that Triton's interpreter (3.6 to 3.9) redoes at every step, done once; what it computes is unchanged.
    Only under the interpreter (TRITON_INTERPRET=1), and once per process.

    - It patches triton.language's builtins on every call of a jit function, the kernel's helpers included, and
      finds them each time by inspect.getmembers over the whole module: a third of the interpreted kernels' time on
      this suite. Here by a list of the builtins' names, made once from the untouched modules (a name is patched
      where it still holds a builtin, as inspect.getmembers would have found it).
    - It maps a Triton type to its numpy dtype by building a 19-entry dict at every call (a tenth of what is left):
      here each element type's answer is kept after its first call.
    - It patches triton.language again at every call of a device function (a kernel's helper), though the launch
      around it has patched the same modules and restores them only when it ends: the patches are the same
      (none depends on the function), so a helper whose module sees no language module the launch's did not is
      not patched again (a quarter of the interpreted kernels' time). The launch's own patching and its
      restore are Triton's, untouched.
    - Every value a kernel computes is built through block_type's and tensor's constructors, which recompute the
      same shape objects each time (the shape unwrapped, validated and named; each dimension wrapped again as a
      constexpr): a third of what was left. Here each (element type, shape) computes them once and the values of
      that shape share them (nothing changes them in place), where the shared objects equal what Triton's own
      constructors make for a sample (_share_shapes).
    And one computation that checked nothing is set aside: the integer-overflow sanitizer recomputes every int32
    add, sub and mul in int64 and compares it with the bounds (about half of what was left), then hands the result
    to device_assert, which without debug=True returns at once: no assertion ever ran. tests/experts/
    test_overflow_sanitizer.py runs every kernel with the sanitizer and debug=True (interpreter_overflow_checks),
    where its assertions do run."""
    import inspect
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if original is None or patch_attr is None or np_dtype is None or getattr(original, "by_name", False):
        return  # another Triton (its own lookups run), or done already
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
    block_type, pointer_type, dtypes = interpreter.tl.block_type, interpreter.tl.pointer_type, {}

    def get_np_dtype(tt_dtype):  # the answer depends on the element type only (a block's, or the scalar itself)
        key = tt_dtype.element_ty if isinstance(tt_dtype, block_type) else tt_dtype
        key = "pointer" if isinstance(key, pointer_type) else key  # every pointer is a uint64 (and unhashable)
        if key not in dtypes:
            dtypes[key] = np_dtype(tt_dtype)
        return dtypes[key]

    interpreter._get_np_dtype = get_np_dtype
    interpreter._patch_lang = _patch_lang_once_per_launch(interpreter)
    _share_shapes(interpreter.tl.core)
    _set_overflow_checks(False)


def _share_shapes(core):
    """block_type and tensor of triton.language.core built with shape objects shared by every value of one (element
    type, shape): patched only if a sample of each equals, attribute by attribute, what Triton's constructors make."""
    import builtins
    import math

    block_init, tensor_init = core.block_type.__init__, core.tensor.__init__
    blocks, tensors = {}, {}

    def block_type_init(self, element_ty, shape):
        try:
            key = (element_ty, builtins.tuple(shape))
            known = blocks.get(key)
        except TypeError:  # a pointer element type is unhashable: Triton's own constructor
            return block_init(self, element_ty, shape)
        if known is None:
            block_init(self, element_ty, shape)
            blocks[key] = (self.shape, self.numel, self.name)
        else:
            self.element_ty = element_ty
            self.shape, self.numel, self.name = known

    def tensor_init_shared(self, handle, type):
        self.handle, self.type, self.dtype = handle, type, type.scalar
        dims = builtins.tuple(type.shape) if type.is_block() else ()
        known = tensors.get(dims)
        if known is None:
            known = tensors[dims] = (core.tuple([core.constexpr(d) for d in dims]), core.constexpr(math.prod(dims)))
        self.shape, self.numel = known

    def made(init, cls, *args):
        obj = cls.__new__(cls)
        init(obj, *args)
        return obj

    def seen(obj):  # the attributes, with tuples and constexprs by their values
        def plain(v):
            if isinstance(v, core.tuple):
                return ("tuple", [plain(x) for x in v.values])
            return ("constexpr", v.value) if isinstance(v, core.constexpr) else (type(v), v)
        return {k: plain(v) for k, v in vars(obj).items()}

    samples = [(core.float32, [16, 32]), (core.int64, core.tuple([core.constexpr(8)]))]
    for elt, shape in samples * 2:  # twice: the second builds from what the first kept
        ours, theirs = made(block_type_init, core.block_type, elt, shape), made(block_init, core.block_type, elt, shape)
        if seen(ours) != seen(theirs) or seen(made(tensor_init_shared, core.tensor, None, ours)) != seen(
                made(tensor_init, core.tensor, None, theirs)):
            return  # another Triton: its own constructors
    if seen(made(tensor_init_shared, core.tensor, None, core.float32)) != seen(
            made(tensor_init, core.tensor, None, core.float32)):
        return
    core.block_type.__init__, core.tensor.__init__ = block_type_init, tensor_init_shared


def _patch_lang_once_per_launch(interpreter):
    """Triton's _patch_lang, which a launch calls (and restores its scope when it ends) and every device function
    inside it calls again (its scope never restored): the inner calls are skipped where the launch has patched
    every language module the function sees."""
    tritons, tl = interpreter._patch_lang, interpreter.tl
    langs_of, launch = {}, []  # the language modules each function sees; those the running launch patched

    class Launch:
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            try:
                self.scope.restore()
            finally:
                launch.clear()

    class Nothing:
        def restore(self):
            pass

    def patch_lang(fn):
        if fn not in langs_of:
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        if launch and langs_of[fn] <= launch[0]:
            return Nothing()  # a device function: its modules are patched by the launch around it
        scope = tritons(fn)
        if launch:  # a device function that sees another module (Triton's own, as tl.core): patched as Triton
            launch[0] |= langs_of[fn]  # does, never restored, so patched for the rest of the launch
            return scope
        launch.append(set(langs_of[fn]))
        return Launch(scope)

    return patch_lang


def _set_overflow_checks(on: bool, debug: bool | None = None):
    """The interpreter's integer-overflow sanitizer on or off (and device asserts with debug); the options before."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    was = builder.options
    builder.options = dataclasses.replace(was, sanitize_overflow=on, debug=was.debug if debug is None else debug)
    return was


@contextlib.contextmanager
def interpreter_overflow_checks():
    """Triton's interpreter with its integer-overflow sanitizer on and debug=True, so that its assertions (and the
    kernels' own device asserts) run: an int32 overflow raises."""
    from triton.runtime import interpreter

    was = _set_overflow_checks(True, debug=True)
    try:
        yield
    finally:
        interpreter.interpreter_builder.options = was
