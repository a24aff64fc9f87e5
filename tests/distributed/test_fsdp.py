"""FSDP2 + expert parallelism on CPU processes (gloo): one training step of the small MoE model on a 2-D mesh
gives every parameter the gradient of one process over the global batch (the mean loss), within fp32 tolerance,
at ep = 2 (efsdp = 1: the expert weights outside FSDP) and at efsdp = 2 × ep = 2 (4 ranks: the expert weights
FSDP-sharded as well), and with the whole model one FSDP2 unit (units="model"). This is the gradient-scale
pitfall's test: without the recipe the expert gradients come out ep times too large. Gradient clipping by the
global norm across the meshes matches one process's clipping."""
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from moeblaze import ExpertsConfig
from moeblaze import ModelConfig, MoEModel
from moeblaze.distributed import clip_grad_norm_, data_parallel_size, parallelize

from helpers import run_ranks

TOL = 1e-5


def _model():
    torch.manual_seed(0)
    return MoEModel(ModelConfig(vocab_size=32, max_seq_len=8, d_model=16, n_layers=2, n_heads=2, num_experts=4,
                                top_k=2, d_expert=16,
                                experts=ExpertsConfig(backend="triton")))


def _loss(model, ids):
    logits, _, _ = model(ids)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _step(rank, world, errors, ep, units="blocks"):
    """One step in this rank, its norm and gradients compared with one process's."""
    ids = torch.randint(0, 32, (2 * world, 8), generator=torch.Generator().manual_seed(1))
    ref = _model()  # one process over the global batch, its gradients clipped to a norm below theirs
    _loss(ref, ids).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert ref_norm > 0.05
    want = {n: p.grad for n, p in ref.named_parameters()}
    model = _model()
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    parallelize(model, mesh, units=units)
    n_units = sum(isinstance(m, FSDPModule) for m in model.modules())
    want_units = 1 if units == "model" else 1 + len(model.blocks) + (2 if world // ep > 1 or ep == 1 else 0)
    if n_units != want_units:
        errors.put(f"rank {rank}: {n_units} FSDP2 units, expected {want_units}")
    mine = ids[2 * rank: 2 * rank + 2]
    (_loss(model, mine) / data_parallel_size(mesh)).backward()
    norm = clip_grad_norm_(model.parameters(), 0.05)
    if not abs(float(norm) - float(ref_norm)) <= TOL * float(ref_norm):
        errors.put(f"rank {rank}: global norm {float(norm)} against one process's {float(ref_norm)}")
    bad = []
    for n, p in model.named_parameters():
        if not isinstance(p.grad, DTensor):
            bad.append(f"{n}: a {type(p.grad).__name__} gradient, not a DTensor")
            continue
        g, w = p.grad.full_tensor(), want[n]  # the expert weights too: one global (E, ...) tensor per name
        err = float((g - w).norm() / w.norm().clamp_min(1e-30))
        if not err <= TOL:
            bad.append(f"{n}: rel err {err:.2e}")
    if bad:
        errors.put(f"rank {rank} (ep {ep}): {bad}")


def _run(world, ep, units="blocks"):
    run_ranks(_step, world, ep, units)


def test_fsdp2_ep2_step_matches_one_process():
    _run(2, 2)


def test_fsdp2_efsdp2_ep2_step_matches_one_process():
    _run(4, 2)


def test_fsdp2_alone_step_matches_one_process():
    _run(2, 1)


def test_fsdp2_on_one_rank_gives_every_parameter_a_dtensor():
    """A one-rank mesh (efsdp 1 x ep 1): the experts are FSDP2 units too, not plain tensors beside the others'
    DTensors, which one fused optimizer step over both refuses."""
    _run(1, 1)


def test_fsdp2_as_one_unit_matches_one_process():
    """units="model": the whole model one FSDP2 unit at ep = 1; at ep = 2 the experts their own (ep mesh)."""
    _run(2, 1, "model")
    _run(2, 2, "model")


def _fp8_model(cache):
    torch.manual_seed(0)
    return MoEModel(ModelConfig(vocab_size=32, max_seq_len=8, d_model=16, n_layers=1, n_heads=2, num_experts=4,
                                top_k=2, d_expert=16,
                                experts=ExpertsConfig(backend="triton", precision="fp8", fp8_min_rows=0,
                                                      fp8_weight_cache=cache)))


def _weight_cache(rank, world, errors):
    import pytest

    one = init_device_mesh("cpu", (world, 1), mesh_dim_names=("efsdp", "ep"))
    with pytest.raises(ValueError, match="fp8_weight_cache=True under FSDP2"):  # FSDP2 gathers the experts
        parallelize(_fp8_model(True), one)
    # ep = the world: the experts are ep-sharded DTensors outside FSDP2 (their local tensors reach the op as new
    # views every call), stepped by a fused AdamW, which moves no version counter: three steps with the cache give
    # the losses of three without it, bit for bit
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("efsdp", "ep"))
    ids = torch.randint(0, 32, (2 * world, 8), generator=torch.Generator().manual_seed(1))[2 * rank: 2 * rank + 2]
    losses = []
    for cache in (False, True):
        model = parallelize(_fp8_model(cache), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        run = []
        for _ in range(3):
            loss = _loss(model, ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(float(loss))
        losses.append(run)
    if losses[0] != losses[1] or len(set(losses[0])) < 3:
        errors.put(f"rank {rank}: losses without the cache {losses[0]}, with it {losses[1]}")


def test_the_fp8_weight_cache_is_refused_under_fsdp2_and_follows_a_fused_optimizer_under_ep():
    run_ranks(_weight_cache, 2)


def _masters_under_autocast(rank, world, errors):
    from moeblaze.distributed import module

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("efsdp", "ep"))
    model = parallelize(_fp8_model(False), mesh)
    seen, real = [], module.ep_experts

    def spy(x, idx, weights, w1, w2, **kw):
        seen.append((x.dtype, w1.dtype, w2.dtype))
        return real(x, idx, weights, w1, w2, **kw)
    module.ep_experts = spy
    try:
        ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model, ids)
        loss.float().backward()
    finally:
        module.ep_experts = real
    if seen != [(torch.float16, torch.float32, torch.float32)]:
        errors.put(f"rank {rank}: the experts' operands {seen}")
    experts = [(n, p.grad) for n, p in model.named_parameters() if ".experts." in n]
    bad = [n for n, g in experts if g is None or g.dtype != torch.float32 or not g.to_local().isfinite().all()]
    if bad or not experts:
        errors.put(f"rank {rank}: expert gradients {bad or 'missing'}")


def test_expert_parallel_under_autocast_hands_fp8_its_float32_shards():
    """precision="fp8" under autocast at ep = world: ExpertParallel passes the local shards of the float32
    parameters (experts.autocast_weights), no half-precision copies; their gradients come back float32."""
    run_ranks(_masters_under_autocast, 2)


def _disagreeing_wraps(rank, world, errors):
    """parallelize where the last rank wraps differently (its resharding, mixed precision, units or model): one
    ValueError on every rank naming what differs, before any FSDP2 collective; then an agreeing parallelize and a
    step run on every rank."""
    import pytest
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    odd = rank == world - 1
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("efsdp", "ep"))
    cases = {"reshard_after_forward": (dict(reshard_after_forward=not odd), "reshard_after_forward"),
             "mixed_precision": (dict(mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if odd else None)),
                                 "MixedPrecisionPolicy; the ranks hold MixedPrecisionPolicys that differ in "
                                 "reduce_dtype"),
             "units": (dict(units="model" if odd else "blocks"), "FSDP2 units"),
             "parameters": ({}, "model parameters")}
    for case, (kw, named) in cases.items():
        model = _model()
        if case == "parameters" and odd:
            model = MoEModel(ModelConfig(vocab_size=32, max_seq_len=8, d_model=16, n_layers=3, n_heads=2,
                                         num_experts=4, top_k=2, d_expert=16, experts=ExpertsConfig(backend="triton")))
        with pytest.raises(ValueError) as caught:
            parallelize(model, mesh, **kw)
        said = [None] * world
        dist.all_gather_object(said, str(caught.value))
        if not (said[rank].startswith("every rank of the data-parallel group must pass the same " + named)
                and len(set(said)) == 1):
            errors.put(f"rank {rank}, {case}: {said}")
    model = parallelize(_model(), mesh)  # the group goes on
    loss = _loss(model, torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank)))
    loss.backward()
    if not torch.isfinite(loss):
        errors.put(f"rank {rank}: the agreeing step's loss is {float(loss)}")


def test_ranks_that_wrap_differently_are_one_error_on_every_rank():
    run_ranks(_disagreeing_wraps, 2)
    run_ranks(_disagreeing_wraps, 4)
