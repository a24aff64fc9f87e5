"""FSDP2 with expert parallelism on a 2-D device mesh (efsdp × ep; ep the inner dimension, on one host's links).

    mesh = init_device_mesh("cuda", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    parallelize(model, mesh)      # then: loss / data_parallel_size(mesh), backward, clip_grad_norm_, step

shard_experts swaps an ExpertParallel (distributed.module) in for every routed experts module: this rank's E / ep
experts, run through ep_experts. parallelize then makes every experts module an FSDP2 unit on
the efsdp dimension (when it has more than one rank, or at ep = 1; else the expert weights stay the ep-sharded
DTensors they are, outside FSDP: every parameter a DTensor, as one fused optimizer step over them needs) and
every block a unit on the whole data-parallel group, the root last. FSDP2 composes with the ep sharding as with
tensor parallelism: an expert weight is then a DTensor on the 2-D mesh, and torch.distributed.checkpoint saves and
loads it (at another mesh shape too) like any other.

parallelize first checks, in one collective, that every rank passes the same mesh, mixed precision, resharding,
units and model parameters: ranks that wrap differently would make different collectives (a hang), so a
difference is one ValueError on every rank, naming it.

Gradient scale (pytorch #160285): expert gradients already sum over the ep group (each rank's experts see every
rank's tokens), while FSDP2 would average over efsdp only. So every unit sums (set_gradient_divide_factor(1.0),
set_force_sum_reduction_for_comms(True)) and the loss is divided by the data-parallel size: every gradient is
then that of the global mean loss, as on one process.

Memory: each rank holds 1 / ep of the expert weights, then 1 / efsdp of that between forward and backward (FSDP2),
and 1 / world of the dense weights; a unit's full weights exist only while it runs.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..configs import UNITS
from .ep import check_agreement
from .module import routed_experts, shard_experts


def data_parallel_size(mesh: DeviceMesh) -> int:
    """How many ranks hold a different batch: every rank of the 2-D mesh (efsdp x ep); divide the loss by it.

    Args:
        mesh: the (efsdp, ep) DeviceMesh parallelize takes.

    Returns:
        The mesh's size, an int.
    """
    return mesh.size()


def check_weight_cache(config, efsdp: int, ep: int) -> None:
    """ValueError where the experts' config keeps fp8 weight copies (fp8_weight_cache) and FSDP2 gathers the experts
    (efsdp > 1, or ep = 1: parallelize makes them a unit then)."""
    if config.fp8_weight_cache and (efsdp > 1 or ep == 1):
        raise ValueError("fp8_weight_cache=True under FSDP2: its all-gather rewrites the gathered expert weights "
                         "without moving their version counters, so cached e4m3 copies could outlive a step, and "
                         "copies of every layer's full weights would undo the sharding; leave it off (it runs in one "
                         "process, and where the experts are ep-sharded outside FSDP2: ep = the world)")


def parallelize(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool = True, units: str = "blocks", **ep_kwargs) -> nn.Module:
    """Expert parallelism on mesh["ep"] and FSDP2 on the rest (see the module header); returns the model.
    reshard_after_forward=False keeps each unit's gathered parameters from its forward to its backward: one
    all-gather per unit and step instead of two, for the memory of the full (1 / ep of the expert) parameters.
    units="model" makes the whole model one FSDP2 unit (the expert modules too where ep = 1; at ep > 1 they stay
    their own units on efsdp, another mesh): one all-gather and one reduce-scatter per step instead of one per block
    and experts module, for a model whose host time per unit, not its memory, is what limits it (the small model:
    about 1 ms of kernels per step), at the memory of every parameter gathered at once.

    Args:
        model: the model (its routed experts modules are swapped for ExpertParallel ones at ep > 1).
        mesh: a 2-D DeviceMesh with dims ("efsdp", "ep").
        mp_policy: FSDP2's MixedPrecisionPolicy (None: its default).
        reshard_after_forward: free each unit's gathered parameters after its forward.
        units: "blocks" (one FSDP2 unit per block and experts module) or "model".
        (ep_config=EPConfig(...) and tracker=: ExpertParallel's options)

    Returns:
        The model, parallelized in place.
    """
    if units not in UNITS:
        raise ValueError(f"units must be one of {UNITS}, got {units!r}")
    mp = mp_policy or MixedPrecisionPolicy()
    dp = init_device_mesh(mesh.device_type, (mesh.size(),), mesh_dim_names=("dp",))
    # ranks that wrap differently make different collectives (FSDP2's all-gathers and reduce-scatters): one error on
    # every rank, naming what differs, before any of them
    check_agreement(dp.get_group(), _of="data-parallel group", entry="parallelize",
                    mesh=(tuple(mesh.shape), mesh.mesh_dim_names), mixed_precision=mp,
                    reshard_after_forward=reshard_after_forward, units=units, parameters=_parameters(model))
    shard_experts(model, mesh["ep"], **ep_kwargs)
    efsdp = mesh["efsdp"]
    whole = units == "model"
    sharded, ignored = [], set()
    for m in routed_experts(model):
        check_weight_cache(m.config, efsdp.size(), mesh["ep"].size())
        if whole and mesh["ep"].size() == 1:
            continue  # in the root's unit
        if efsdp.size() > 1 or mesh["ep"].size() == 1:  # (one rank: a unit still, so every parameter is a DTensor)
            sharded.append(fully_shard(m, mesh=efsdp, mp_policy=mp, reshard_after_forward=reshard_after_forward))
        else:  # ep-sharded DTensors already, on ranks of their own
            ignored |= set(m.parameters())
    for block in [] if whole else getattr(model, "blocks", []):
        sharded.append(fully_shard(block, mesh=dp, mp_policy=mp, ignored_params=ignored & set(block.parameters()),
                                   reshard_after_forward=reshard_after_forward))
    # the root's parameters (embeddings, final norm) are used again first thing in backward: kept gathered
    sharded.append(fully_shard(model, mesh=dp, mp_policy=mp, ignored_params=ignored, reshard_after_forward=False))
    for unit in sharded:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return model


def _parameters(model: nn.Module) -> str:
    """The model's parameters as the ranks compare them: their count and elements, and a CRC of their names,
    shapes and dtypes."""
    params = list(model.named_parameters())
    crc = zlib.crc32(repr([(n, tuple(p.shape), str(p.dtype)) for n, p in params]).encode())
    return f"{len(params)} tensors, {sum(p.numel() for _, p in params):,} elements, CRC {crc:08x}"


def clip_grad_norm_(parameters, max_norm: float, group=None) -> torch.Tensor:
    """Scale every gradient so that their global L2 norm over all ranks of `group` (default: the world) is at most
    max_norm; returns the norm before clipping. Under parallelize every gradient element lives on exactly one
    rank (FSDP2's shards and each ep rank's own experts, all DTensors), so
    the squares are summed once over the ranks: one all-reduce, no host sync; a few kernels per dtype.

    Args:
        parameters: an iterable of parameters (DTensors or tensors) whose gradients are clipped in place.
        max_norm: the largest global L2 norm kept.
        group: the process group the squares are summed over (None: the world).

    Returns:
        The global norm before clipping, an fp32 scalar tensor.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = local[0].device if local else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    by_dtype: dict = {}
    for g in local:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():  # one norm kernel per dtype, not one per gradient
        sq = sq + torch.stack(torch._foreach_norm(same)).float().square().sum()
    dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for same in by_dtype.values():
        torch._foreach_mul_(same, scale.to(same[0].dtype))
    return norm
