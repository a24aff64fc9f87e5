"""Several processes: expert parallelism over torch.distributed (ep). See distributed.ep for the data flow, the
dispatch modes and the memory contract."""
from .ep import DISPATCHES, CapacityTracker, ep_experts, receiver_index

__all__ = ["DISPATCHES", "CapacityTracker", "ep_experts", "receiver_index"]
