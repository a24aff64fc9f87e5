"""Expert parallelism's transports by name (EPConfig.transport): how one layer call moves its tokens to the ranks
that hold their experts and back. Each transport is one module that owns its plan, its custom-op pair (with its
fakes for torch.compile) and the state its backward keeps, and exports run(EPCall) -> (out, needed); a new one is
that module and one line below. What every transport shares is decided once, in distributed.ep: the checks, the
capacity (capacity_rows, from the transport's mean rows per destination), the overflow rule (fail_on_overflow:
on_overflow="error" unless a CapacityTracker sizes the capacity).

  pairs   one row per (token, expert) pair (distributed.pairs): each rank's results equal one GPU's bit for bit.
          chunks = G (exact dispatch): the local experts in G groups, a group's all-to-alls under another's GEMMs.
  tokens  one row per (token, rank), the experts there gathering it and one partial sum returned
          (distributed.tokens): equal to one GPU within the op's rounding; fewer bytes wherever K > 1. chunks = P:
          each destination's rows in P parts, a part's all-to-alls under another part's GEMMs.
"""
from __future__ import annotations

import math
from typing import NamedTuple
from collections.abc import Callable

import torch

from . import pairs, tokens


class EPCall(NamedTuple):
    """One expert-parallel layer call, checked (distributed.ep): x (L, D), global expert ids topk_idx (L, K) and
    their weights topk_w, this rank's experts (w1 or its gate rows, w2, w1_up or None), the group's name, the op's
    key, the capacity (rows per pair of ranks; None: exact dispatch), whether an overflow is an error on every
    rank, the groups of local experts (chunks), the routing index's builder, the experts over all ranks (E), the
    dtype rows cross in (wire: EPConfig.wire) and the signature of the values the ranks agreed on (agreed:
    stops.signature; the transport's first exchange, stops.exchange, carries it)."""
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    w1_up: torch.Tensor | None
    group_name: str
    key: str
    capacity: int | None
    fail_on_overflow: bool
    chunks: int
    index_method: str
    num_experts: int
    wire: str = "native"
    agreed: int = 0


class Transport(NamedTuple):
    """A registered transport: run(call) -> (out (L, D), the most rows any destination needed (0-d int64)), the
    mean rows one token sends to one destination, mean_rows(K, ep, E_loc), the most rows a source can send one
    destination, max_rows(L, K, E_loc) (math.inf: no bound taken), the rows this rank's routing sends each
    destination, rows_per_dest(topk_idx, E_loc, ep) -> (ep,) (no host sync), the pairs each received row carries
    in the receiver's index (pairs_per_row(K)), whether that index always holds dropped pairs (sentinels), and
    the dispatch modes in which it takes EPConfig.chunks (chunks: the all-to-alls pipelined under the GEMMs) and
    whether those chunks group the local experts (so that there can be no more of them than local experts), and
    the shape of its first exchange, first_exchange(ep, E_loc, capacity) (stops.exchange: a rank that refuses its
    inputs makes it, so that the others stop with it; None: that rank raises alone), and the EPConfig.wire values
    it sends rows in (wires)."""
    run: Callable
    mean_rows: Callable[[int, int, int], float]
    max_rows: Callable[[int, int, int], float]
    rows_per_dest: Callable
    pairs_per_row: Callable[[int], int]
    sentinels: bool = False
    chunks: tuple[str, ...] = ()
    expert_chunks: bool = False
    first_exchange: Callable | None = None
    wires: tuple[str, ...] = ("native",)


def _hit_fraction(K: int, ep: int, E_loc: int) -> float:
    """The chance that a token's K distinct experts, uniform over ep·E_loc, include one of a given rank's E_loc."""
    E = ep * E_loc
    miss = 1.0
    for i in range(K):
        miss *= max(0.0, (E - E_loc - i) / (E - i))
    return 1.0 - miss


TRANSPORTS: dict[str, Transport] = {
    "pairs": Transport(pairs.run, lambda K, ep, E_loc: K / ep, lambda L, K, E_loc: math.inf, pairs.rows_sent,
                       lambda K: 1, chunks=("exact",), expert_chunks=True, first_exchange=pairs.first_exchange),
    "tokens": Transport(tokens.run, _hit_fraction, lambda L, K, E_loc: L, tokens.rows_sent, lambda K: K,
                        sentinels=True, chunks=("exact", "capacity"), first_exchange=tokens.first_exchange,
                        wires=("native", "e4m3")),
}


def register(name: str, t: Transport) -> None:
    """Register a transport under `name` (EPConfig(transport=name) then runs it); ValueError where the name is
    taken."""
    if not isinstance(t, Transport):
        raise TypeError(f"a transport is a moeblaze.distributed.transports.Transport, got {type(t).__name__}")
    if name in TRANSPORTS:
        raise ValueError(f"a transport is registered as {name!r} already")
    TRANSPORTS[name] = t


def transport(name: str) -> Transport:
    """The transport registered under `name`; ValueError naming the registered ones otherwise."""
    if not isinstance(name, str) or name not in TRANSPORTS:
        raise ValueError(f"EPConfig.transport must be one of {tuple(TRANSPORTS)}, got {name!r}")
    return TRANSPORTS[name]


def capacity_rows(t: Transport, factor: float, L: int, K: int, ep: int, E_loc: int) -> int:
    """Capacity dispatch's rows per (source, destination) pair sized by capacity_factor: factor x the mean rows a
    destination gets from L tokens, at most what a source can send it, rounded up to 16."""
    rows = min(math.ceil(factor * L * t.mean_rows(K, ep, E_loc)), t.max_rows(L, K, E_loc))  # an int
    return -(-max(1, rows) // 16) * 16
