"""The routing index: everything a zero-buffer MoE layer needs to move tokens, in O(L·K) int32.

    expert_counts     (E,)    tokens routed to each expert
    expert_offsets    (E+1,)  exclusive prefix sum of the counts; expert e owns rows [off[e], off[e+1])
    expert_token_idx  (L·K,)  token ids grouped expert by expert, ascending inside each expert
    token_slot        (L, K)  position of pair (t, k) in that order: expert_token_idx[token_slot[t, k]] == t

No (L·K, D) copy of the activations is ever made: kernels gather rows of x through expert_token_idx
and combine through token_slot. Memory: 4·(2·L·K + 2·E + 1) bytes.

Dropped pairs (build_routing_index(..., sentinels=True)): ids >= E mark pairs that no local expert takes
(expert parallelism's sentinels, as in transformers). They are placed after every expert's rows, in
[expert_offsets[E], L·K); no expert kernel reads or writes them, and the combines (output, dx) and the
router-weight gradient treat them as zero. Without sentinels, expert_offsets[E] == L·K.

Builders (identical results, both deterministic, neither synchronizes with the host):
  "sort":  stable argsort of the flattened expert ids (the conventional way; cost independent of E).
  "dense": MoEBlaze's sort-free, atomic-free build. Triton on GPUs (see routing/triton.py: the hit
           map lives in registers, tile by tile; only per-tile counts, n_tiles x E int32, reach
           memory); on the CPU a PyTorch version that materializes the L x E int32 hit map. Its work
           grows as L·K·E (every pair is compared against every expert), so for many experts the
           sort wins. Measured on an H100 with the placement's register gather (K = 8; benchmarks/results/
           nvidia-h100-index-gather.log): dense is 2.3x-3.7x faster than sort at 128 experts and 1.35x-4.0x
           at 256, at L = 4k..512k; at 512 experts 3.4-3.7x up to 32k tokens, 1.07x at 128k, 0.80x at
           512k. "auto" therefore uses "dense" up to DENSE_MAX_EXPERTS = 256 experts and "sort" beyond.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..env import INTERPRET
from .checks import check_num_experts, check_topk_idx

METHODS = ("auto", "dense", "sort")
# Above this many experts the dense build's O(L·K·E) compare work overtakes a radix sort's O(L·K)
# passes at large L (see the module header and the dispatch table in benchmarks/results/).
DENSE_MAX_EXPERTS = 256


@dataclass
class RoutingIndex:
    """The O(L·K) routing index: the (token, expert) pairs in expert order, no token copied.

    Args:
        expert_counts: (E,) int32 pairs routed to each expert.
        expert_offsets: (E + 1,) int32 first row of each expert (expert_offsets[E] = the rows kept).
        expert_token_idx: (R,) int32 the token of each row, experts' rows contiguous.
        token_slot: (L, K) int32 the row of pair (t, k).
        dropped: built with sentinels: rows past expert_offsets[E] may be dropped pairs.
    """
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    expert_token_idx: torch.Tensor
    token_slot: torch.Tensor
    dropped: bool = False  # built with sentinels: rows [expert_offsets[E], L·K) may be dropped pairs

    @property
    def num_experts(self) -> int:
        return self.expert_counts.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.token_slot.shape[0]

    @property
    def top_k(self) -> int:
        return self.token_slot.shape[1]

    def tensors(self):
        return self.expert_counts, self.expert_offsets, self.expert_token_idx, self.token_slot

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def topk_idx(self) -> torch.Tensor:
        """(L, K) int32 expert ids recovered from the index (the expert owning each pair's slot)."""
        return pair_experts(self.expert_offsets, self.token_slot)


def pair_experts(expert_offsets: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
    """(L, K) int32: the expert owning each pair's row (E for a dropped pair's), from the offsets (E + 1,)."""
    return torch.searchsorted(expert_offsets[1:].contiguous(), token_slot.contiguous(), right=True, out_int32=True)


def in_row_order(values_LK: torch.Tensor, token_slot: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """(rows,) values of the pairs (router weights) placed at their rows: out[token_slot[t, k]] = values[t, k], for
    an index of `rows` rows (L·K for top-k; a rounded or capacity index may have more rows than pairs, or fewer).
    A dropped pair (slot >= rows) lands nowhere; rows no pair owns hold zeros. No host sync."""
    out = torch.zeros(rows + 1, dtype=dtype, device=values_LK.device)
    out[token_slot.reshape(-1).long().clamp(max=rows)] = values_LK.reshape(-1).to(dtype)
    return out[:rows]


def count_per_expert(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int32 number of (token, k) pairs routed to each expert, without a host sync (torch.bincount
    would read the largest id back to size its output)."""
    flat = topk_idx.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))


def _offsets(counts_E: torch.Tensor) -> torch.Tensor:
    return F.pad(counts_E.cumsum(0, dtype=torch.int32), (1, 0))


def build_index_sort(topk_idx_LK: torch.Tensor, num_experts: int) -> RoutingIndex:
    """Conventional build: stable argsort of the L·K expert ids (pair order is token-major, so a stable
    sort keeps tokens ascending inside each expert)."""
    L, K = topk_idx_LK.shape
    flat = topk_idx_LK.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = count_per_expert(flat, num_experts)
    slot = torch.empty(L * K, dtype=torch.int32, device=flat.device)
    slot[order] = torch.arange(L * K, dtype=torch.int32, device=flat.device)
    return RoutingIndex(counts, _offsets(counts), (order // K).to(torch.int32), slot.view(L, K))


def build_index_dense_torch(topk_idx_LK: torch.Tensor, num_experts: int) -> RoutingIndex:
    """MoEBlaze's build in PyTorch (the CPU path): L x E hit map, column reductions for the counts, a
    prefix sum for the offsets, and a column scan that gives every pair its final slot."""
    L, K = topk_idx_LK.shape
    dev = topk_idx_LK.device
    idx = topk_idx_LK.long()
    hits_LE = torch.zeros(L, num_experts, dtype=torch.int32, device=dev).scatter_(1, idx, 1)
    incl_LE = hits_LE.cumsum(0, dtype=torch.int32)
    counts = hits_LE.sum(0, dtype=torch.int32)
    offsets = _offsets(counts)
    slot_LK = (offsets[idx] + (incl_LE - hits_LE).gather(1, idx)).to(torch.int32)
    tokens = torch.arange(L, dtype=torch.int32, device=dev).repeat_interleave(K)
    expert_token_idx = torch.empty(L * K, dtype=torch.int32, device=dev).scatter_(0, slot_LK.reshape(-1).long(), tokens)
    return RoutingIndex(counts, offsets, expert_token_idx, slot_LK)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dense_tile_size(num_experts: int) -> int:
    """Tokens per tile: keep the register hit map near 8k int32 (BLOCK_L x E_PAD), 16..1024 tokens."""
    return max(16, min(1024, 8192 // _next_pow2(num_experts)))


def build_index_dense_triton(topk_idx_LK: torch.Tensor, num_experts: int) -> RoutingIndex:
    """MoEBlaze's build in three Triton launches: per-tile counts, column scan, placement."""
    from ..launch import launch
    from .triton import routing_place_kernel, routing_tile_count_kernel, routing_tile_scan_kernel

    L, K = topk_idx_LK.shape
    E = num_experts
    dev = topk_idx_LK.device
    idx = topk_idx_LK.contiguous()
    E_PAD = _next_pow2(E)
    BLOCK_L = dense_tile_size(E)
    n_tiles = max(1, -(-L // BLOCK_L))
    tile_base = torch.empty(n_tiles, E, dtype=torch.int32, device=dev)
    launch(routing_tile_count_kernel, (n_tiles,), idx, tile_base, L, E, K=K, BLOCK_L=BLOCK_L, E_PAD=E_PAD)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    block_e = min(E_PAD, 32)
    launch(routing_tile_scan_kernel, (-(-E // block_e),), tile_base, counts, n_tiles, E,
           BLOCK_T=max(16, 4096 // block_e), BLOCK_E=block_e)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=dev)
    expert_token_idx = torch.empty(L * K, dtype=torch.int32, device=dev)
    slot = torch.empty(L, K, dtype=torch.int32, device=dev)
    launch(routing_place_kernel, (n_tiles,), idx, tile_base, counts, offsets, expert_token_idx, slot, L, E,
           K=K, BLOCK_L=BLOCK_L, E_PAD=E_PAD)
    return RoutingIndex(counts, offsets, expert_token_idx, slot)


def _triton_usable(t: torch.Tensor) -> bool:
    return t.is_cuda or INTERPRET


def build_routing_index(topk_idx_LK: torch.Tensor, num_experts: int, method: str = "auto",
                        check: bool = True, sentinels: bool = False) -> RoutingIndex:
    """Build the RoutingIndex of a top-k routing. `check` validates ids (range, duplicates) without a
    host sync on accelerators (see routing/checks.py). sentinels=True accepts ids >= num_experts (any number of
    them per token) as dropped pairs (see the module header): pair (t, k) with such an id goes to a sink expert
    E + k of an index over E + K experts, whose counts and offsets are then cut back to E.

    Args:
        topk_idx_LK: (L, K) integer expert ids, distinct per token.
        num_experts: E.
        method: "auto" (default), "dense" (sort-free) or "sort".
        check: validate the ids.
        sentinels: ids >= E are dropped pairs.

    Returns:
        The RoutingIndex (O(L·K) int32), on topk_idx's device.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    num_experts = check_num_experts(num_experts)  # a numpy integer as the int the kernels take
    if sentinels:
        check_topk_idx(topk_idx_LK, num_experts + topk_idx_LK.shape[-1], check_values=False)
        K = topk_idx_LK.shape[1]
        sink = torch.arange(num_experts, num_experts + K, dtype=topk_idx_LK.dtype, device=topk_idx_LK.device)
        ids = torch.where(topk_idx_LK >= num_experts, sink, topk_idx_LK)
        check_topk_idx(ids, num_experts + K, check_values=check)  # negative ids, duplicates among real ones
        r = build_routing_index(ids, num_experts + K, method, check=False)
        return RoutingIndex(r.expert_counts[:num_experts], r.expert_offsets[: num_experts + 1], r.expert_token_idx,
                            r.token_slot, dropped=True)
    check_topk_idx(topk_idx_LK, num_experts, check_values=check)
    if method == "auto":
        method = "dense" if num_experts <= DENSE_MAX_EXPERTS else "sort"
    if method == "sort":
        return build_index_sort(topk_idx_LK, num_experts)
    if _triton_usable(topk_idx_LK) and topk_idx_LK.shape[0] > 0:
        return build_index_dense_triton(topk_idx_LK, num_experts)
    return build_index_dense_torch(topk_idx_LK, num_experts)
