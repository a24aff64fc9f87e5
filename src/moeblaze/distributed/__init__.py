"""Several processes: expert parallelism over torch.distributed (ep) and FSDP2 on a 2-D mesh with it. See
distributed.ep for the data flow, the dispatch modes and the memory contract; distributed.module for the experts
module over an ep group (ExpertParallel, shard_experts); distributed.fsdp for the mesh, the units and the gradient
scale."""
from ..configs import DISPATCHES, UNITS
from .ep import CapacityTracker, ep_experts, receiver_index
from .fsdp import clip_grad_norm_, data_parallel_size, parallelize
from .module import ExpertParallel, shard_experts

__all__ = ["DISPATCHES", "UNITS", "CapacityTracker", "ExpertParallel", "clip_grad_norm_", "data_parallel_size",
           "ep_experts", "parallelize", "receiver_index", "shard_experts"]
