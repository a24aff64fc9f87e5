"""Several processes: expert parallelism over torch.distributed (ep). See distributed.ep for the data flow and its
memory contract."""
from .ep import ep_experts, receiver_index

__all__ = ["ep_experts", "receiver_index"]
