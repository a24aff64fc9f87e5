"""The tile schedule of the expert GEMMs: which expert and which first row each tile of BLOCK_M rows covers,
built on the device from the per-expert counts, so no launch waits for the host to learn the tile count.

RowPlan: a routing's rows in expert order with their schedule, what every stage walks.
Memory: 4·(2·(L·K // BLOCK_M + E) + 1) bytes (tile_expert, tile_row and the used-tile count), built once
in forward and kept for backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..env import INTERPRET
from ..launch import cdiv, launch
from ..routing import RoutingIndex
from ..routing.index import pair_experts

BLOCK_M = 16 if INTERPRET else 128  # rows per tile of every expert GEMM (the Gluon kernels' too)


@triton.jit
def _tile_schedule_kernel(counts_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, used_ptr, E, MAX_TILES,
                          BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, BLOCK_T: tl.constexpr):
    """The row-tile schedule of the expert kernels: for tile ids t < MAX_TILES, the expert whose rows
    tile t covers (tiles of BLOCK_M rows, expert by expert; -1 past the last used tile) and its first
    row; program 0 also writes the number of used tiles. Each program rebuilds the per-expert tile
    prefix sum from the E counts (E_POW2 >= E) and finds its tiles' experts by comparison."""
    ex = tl.arange(0, E_POW2)
    n_tiles = (tl.load(counts_ptr + ex, mask=ex < E, other=0) + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(n_tiles, 0)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), 1)  # experts whose tiles all lie before t
    valid = e < E
    first_tile = tl.sum(tl.where(ex[None, :] == e[:, None], tile_end - n_tiles, 0), 1)
    row = tl.load(offsets_ptr + e, mask=valid, other=0) + (t - first_tile) * BLOCK_M
    tmask = t < MAX_TILES
    tl.store(tile_expert_ptr + t, tl.where(valid, e, -1), mask=tmask)
    tl.store(tile_row_ptr + t, tl.where(valid, row, 0), mask=tmask)
    one = tl.arange(0, 1)
    tl.store(used_ptr + one, tl.sum(n_tiles, 0) + one, mask=one + tl.program_id(0) == 0)


def tile_schedule(expert_counts: torch.Tensor, expert_offsets: torch.Tensor, num_rows: int,
                  block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tile_expert, tile_row, used) int32: the expert and first row of every block_m row tile, expert
    by expert, of length num_rows // block_m + E (a bound on the tile count that needs no host sync)
    with expert -1 marking the unused tail, and the number of used tiles (one element, for persistent
    kernels). One launch on the device."""
    E = expert_counts.shape[0]
    max_tiles = num_rows // block_m + E
    dev = expert_counts.device
    tile_expert = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    tile_row = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    e_pow2 = triton.next_power_of_2(E)
    block_t = max(1, min(128, 8192 // e_pow2))  # a (block_t, e_pow2) comparison per program
    launch(_tile_schedule_kernel, (cdiv(max_tiles, block_t),), expert_counts, expert_offsets, tile_expert,
           tile_row, used, E, max_tiles, BLOCK_M=block_m, E_POW2=e_pow2, BLOCK_T=block_t, num_warps=4)
    return tile_expert, tile_row, used


@dataclass(frozen=True)
class RowPlan:
    """The R routed rows of one routing in expert order, and the tile schedule every expert GEMM walks.

    token_R: expert_token_idx (each row's token); offsets_E1: expert e owns rows [offsets[e], offsets[e+1]);
    token_slot_LK: the row of pair (t, k); tile_expert, tile_row, tiles_used: the schedule (experts.schedule).
    """
    token_R: torch.Tensor
    offsets_E1: torch.Tensor
    token_slot_LK: torch.Tensor
    tile_expert: torch.Tensor
    tile_row: torch.Tensor
    tiles_used: torch.Tensor

    @classmethod
    def build(cls, routing: RoutingIndex, block_m: int = BLOCK_M) -> RowPlan:
        """The plan of a routing index: its arrays and a fresh tile schedule (one launch)."""
        sched = tile_schedule(routing.expert_counts, routing.expert_offsets, routing.expert_token_idx.shape[0],
                              block_m)
        return cls(routing.expert_token_idx, routing.expert_offsets, routing.token_slot, *sched)

    @property
    def sched(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tile_expert, self.tile_row, self.tiles_used

    @property
    def kept(self) -> torch.Tensor:
        """(1,) int32: rows [0, kept) belong to experts; the rest are dropped pairs (routing.index's sentinels)."""
        return self.offsets_E1[-1:]

    @property
    def pair_expert(self) -> torch.Tensor:
        """(L, K) int32: the expert of each pair (E for dropped pairs), from its row and the offsets."""
        return pair_experts(self.offsets_E1, self.token_slot_LK)

    @property
    def num_rows(self) -> int:
        return self.token_R.shape[0]


def whole_w1(w1_EFD: torch.Tensor, w1_up: torch.Tensor | None) -> torch.Tensor:
    """W1 (E, F, D): w1 itself, or [gate rows | up rows] where the up rows come apart (a transient copy)."""
    return w1_EFD if w1_up is None else torch.cat((w1_EFD, w1_up), 1)
