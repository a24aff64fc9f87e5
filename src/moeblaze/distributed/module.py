"""ExpertParallel: an experts module whose E experts are split over the ranks of an ep group, and shard_experts,
which swaps it in for every routed experts module of a model.

It takes the module's place (by composition: a module of its own, built from the Experts module it replaces,
not a subclass of it) and its parameters' names (w1, w2: DTensors sharded on dim 0 over the ep mesh, so
that each keeps one global name and shape for checkpoints), holds this rank's E / ep experts, and runs them through
ep_experts (distributed.ep: the data flow and the memory contract) with the module's own recipe. Shared experts
(always on, never routed) stay whole on every rank.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..configs import EPConfig
from ..experts import routed_call
from ..nn import Experts, SharedExperts
from ..nn.moe import describe_experts
from .ep import check_agreement, check_ep, check_options, ep_experts
from .plan import CapacityTracker


class ExpertParallel(nn.Module):
    """`experts`' computation with its experts split over ep_mesh's ranks (this rank keeps its E / ep of them; the
    weights stay DTensors of the global shape). ep_config (a moeblaze.EPConfig; None: exact dispatch) and tracker:
    as for moeblaze.distributed.ep_experts. Every rank of the group calls it together; token rounding's prebuilt
    index is not available here.

    Args:
        experts: the routed moeblaze.nn.Experts module it replaces (its weights are split, each rank keeping its own).
        ep_mesh: a 1-D DeviceMesh over the expert-parallel ranks.
        ep_config: the dispatch, a moeblaze.EPConfig (None: exact).
        tracker: a CapacityTracker for capacity dispatch's reruns, or None.

    Returns:
        forward(x (L, D), topk_idx (L, K), topk_weights (L, K)) -> (L, D), as Experts.forward.
    """

    def __init__(self, experts: Experts, ep_mesh: DeviceMesh, *, ep_config: EPConfig | None = None,
                 tracker: CapacityTracker | None = None):
        super().__init__()
        if not isinstance(experts, Experts) or isinstance(experts, (SharedExperts, ExpertParallel)):
            raise TypeError(f"ExpertParallel wraps a routed moeblaze.nn.Experts module, got {type(experts).__name__}")
        check_options(experts.config)
        ep_config, _ = check_ep(ep_config, tracker)  # refused here, by name, before any collective
        if not isinstance(ep_mesh, DeviceMesh):
            raise TypeError(f"ep_mesh must be a 1-D torch DeviceMesh (e.g. init_device_mesh(device, (ep,))), got "
                            f"{type(ep_mesh).__name__}")
        if ep_mesh.ndim != 1:
            raise ValueError(f"ep_mesh must be 1-D, got a {ep_mesh.ndim}-D mesh {tuple(ep_mesh.mesh.shape)}: pass its "
                             "expert-parallel dimension, e.g. mesh['ep']")
        ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
        E = experts.num_experts
        # before any collective of the forward: ranks that disagree on the shape or the recipe would run different
        # collectives (a hang or an abort) or different arithmetic (silently)
        check_agreement(ep_mesh.get_group(), num_experts=E, shape=(experts.d_model, experts.d_expert),
                        recipe=experts.config, ep_config=ep_config, tracker=tracker is not None)
        if E % ep:
            raise ValueError(f"{E} experts do not split over ep = {ep} ranks")
        self.config, self.d_model, self.d_expert, self.num_experts = (experts.config, experts.d_model,
                                                                      experts.d_expert, E)
        lo, hi = rank * (E // ep), (rank + 1) * (E // ep)
        for name in ("w1", "w2"):
            local = getattr(experts, name).detach()[lo:hi].clone()
            setattr(self, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)))
        self.group = ep_mesh.get_group()
        self.ep_config, self.tracker = ep_config, tracker
        # under on_overflow="drop": the rows this rank has dropped, a device counter (None otherwise)
        dropping = ep_config.dispatch == "capacity" and ep_config.overflow == "drop" and tracker is None
        self.register_buffer("dropped_rows", torch.zeros((), dtype=torch.int64, device=experts.w1.device)
                             if dropping else None, persistent=False)

    def weights(self):
        w1, w2 = self.w1, self.w2
        if isinstance(w1, DTensor):  # over the ep mesh (so too while FSDP2 on efsdp has them gathered): this rank's
            w1, w2 = w1.to_local(), w2.to_local()
        return w1, w2

    def forward(self, x_LD, topk_idx, topk_weights, routing=None):
        if routing is not None:
            raise NotImplementedError("a prebuilt routing index (token rounding) under expert parallelism")
        across = functools.partial(ep_experts, group=self.group, experts=self.config, ep_config=self.ep_config,
                                   tracker=self.tracker, dropped=self.dropped_rows)
        return routed_call(x_LD, topk_idx, topk_weights, *self.weights(), experts=self.config, across=across)

    def extra_repr(self) -> str:
        c = self.ep_config
        return describe_experts(self) + f", ep={self.group.size()}, dispatch={c.dispatch}, transport={c.transport}"


def routed_experts(model: nn.Module) -> list:
    """The routed experts modules of a model (plain or expert-parallel; shared experts excluded)."""
    return [m for m in model.modules()
            if isinstance(m, ExpertParallel) or isinstance(m, Experts) and not isinstance(m, SharedExperts)]


def shard_experts(model: nn.Module, ep_mesh: DeviceMesh, **options) -> int:
    """Swap an ExpertParallel (options: its ep_config and tracker) in for every routed experts module of `model` on
    ep_mesh (nothing at ep = 1: every rank then holds every expert); the number of modules swapped.

    Args:
        model: the model whose routed experts modules are swapped in place.
        ep_mesh: a 1-D DeviceMesh over the expert-parallel ranks.
        (ep_config=EPConfig(...), tracker=: ExpertParallel's options)

    Returns:
        The number of modules swapped (0 at ep = 1).
    """
    if ep_mesh.size() == 1:
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Experts) and not isinstance(child, (SharedExperts, ExpertParallel)):
                setattr(parent, name, ExpertParallel(child, ep_mesh, **options))
                swapped += 1
    return swapped
