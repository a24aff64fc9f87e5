"""Several processes: expert parallelism over torch.distributed (ep) and FSDP2 on a 2-D mesh with it. See
distributed.ep for the data flow, the dispatch modes and the memory contract; distributed.module for the experts
module over an ep group (ExpertParallel, shard_experts); distributed.fsdp for the mesh, the units and the gradient
scale."""
from ..configs import DISPATCHES, UNITS, EPConfig  # noqa: F401  (the choices, importable here too)
from .ep import ep_experts
from .plan import CapacityTracker, receiver_index  # noqa: F401  (receiver_index: the receiver's index)
from .fsdp import clip_grad_norm_, data_parallel_size, parallelize
from .module import ExpertParallel, shard_experts

__all__ = ["CapacityTracker", "EPConfig", "ExpertParallel", "clip_grad_norm_", "data_parallel_size", "ep_experts",
           "parallelize", "shard_experts"]
