"""Triton kernels of MoEBlaze's sort-free, atomic-free routing index build.

Three launches. (1) The dense (token x expert) hit map of one tile of BLOCK_L tokens lives in
registers only; each tile writes its per-expert counts (n_tiles x E int32). (2) A column scan over the
tiles turns them into each tile's first position inside each expert's segment, and the column totals
into the per-expert counts. (3) The placement kernel derives the expert offsets from the counts, scans
its hit map down the columns and writes each (token, k) pair straight to its final slot. Each slot is written by
exactly one program, so no atomics are needed and the result is deterministic, with tokens ascending
inside each expert.
"""
import triton
import triton.language as tl


@triton.jit
def _tile_hits(topk_idx_ptr, t, L, e, K: tl.constexpr, BLOCK_L: tl.constexpr, E_PAD: tl.constexpr):
    """(BLOCK_L, E_PAD) int32: 1 where token t routes to expert e."""
    hits = tl.zeros((BLOCK_L, E_PAD), dtype=tl.int32)
    for k in tl.static_range(K):
        ek = tl.load(topk_idx_ptr + t * K + k, mask=t < L, other=-1).to(tl.int32)
        hits += (ek[:, None] == e[None, :]).to(tl.int32)
    return hits


@triton.jit
def routing_tile_count_kernel(topk_idx_ptr, tile_counts_ptr, L, E,
                               K: tl.constexpr, BLOCK_L: tl.constexpr, E_PAD: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    e = tl.arange(0, E_PAD)
    counts = tl.sum(_tile_hits(topk_idx_ptr, t, L, e, K, BLOCK_L, E_PAD), axis=0)
    tl.store(tile_counts_ptr + pid * E + e, counts, mask=e < E)


@triton.jit
def routing_tile_scan_kernel(tile_counts_ptr, expert_counts_ptr, n_tiles, E,
                              BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """In place: tile_counts[i, e] -> sum_{j < i} tile_counts[j, e]; expert_counts[e] = column total.
    One program per BLOCK_E experts walks down the tiles, carrying the running sum."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < E
    carry = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for t0 in range(0, n_tiles, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        mask = (t < n_tiles)[:, None] & emask[None, :]
        ptrs = tile_counts_ptr + t[:, None] * E + e[None, :]
        c = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, carry[None, :] + tl.cumsum(c, axis=0) - c, mask=mask)
        carry += tl.sum(c, axis=0)
    tl.store(expert_counts_ptr + e, carry, mask=emask)


@triton.jit
def routing_place_kernel(topk_idx_ptr, tile_base_ptr, expert_counts_ptr, expert_offsets_ptr,
                          expert_token_idx_ptr, token_slot_ptr, L, E,
                          K: tl.constexpr, BLOCK_L: tl.constexpr, E_PAD: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    e = tl.arange(0, E_PAD)
    emask = e < E
    hits = _tile_hits(topk_idx_ptr, t, L, e, K, BLOCK_L, E_PAD)
    counts = tl.load(expert_counts_ptr + e, mask=emask, other=0)
    offsets = tl.cumsum(counts, axis=0) - counts  # exclusive: where each expert's segment starts
    if pid == 0:
        tl.store(expert_offsets_ptr + e, offsets, mask=emask)
        tl.store(expert_offsets_ptr + E, tl.sum(counts, axis=0))
    # first slot of this tile inside each expert's segment: expert start + tokens of earlier tiles
    base = offsets + tl.load(tile_base_ptr + pid * E + e, mask=emask, other=0)
    pos = base[None, :] + tl.cumsum(hits, axis=0) - hits  # exclusive scan down each expert column
    tmask = t < L
    for k in tl.static_range(K):
        ek = tl.load(topk_idx_ptr + t * K + k, mask=tmask, other=-1).to(tl.int32)
        slot = tl.sum(tl.where(ek[:, None] == e[None, :], pos, 0), axis=1)
        tl.store(token_slot_ptr + t * K + k, slot, mask=tmask)
        tl.store(expert_token_idx_ptr + slot, t, mask=tmask)
