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


# The same three steps for a token-rounded routing (routing.rounding.rounded_index), whose pairs come as a dense
# (L, E) mask with a varying number of experts per token. Two passes of count-and-scan: the first places every
# kept pair, which tells which fit (row < max_rows and the token's place among its experts < max_experts), the
# second places the pairs that fit; the placement fills each token's max_experts-wide table, empty places
# pointing to the sink row (max_rows, always in the dropped tail).

@triton.jit
def _kept_tile(kept_ptr, t, L, e, E):
    """(BLOCK_L, E_PAD) int32: 1 where token t keeps expert e."""
    mask = (t < L)[:, None] & (e < E)[None, :]
    return tl.load(kept_ptr + t.to(tl.int64)[:, None] * E + e[None, :], mask=mask, other=0).to(tl.int32)


@triton.jit
def _place(hits, pid, e, E, tile_base_ptr, counts_ptr):
    """Each hit's row in expert-major order (experts' segments from their counts, tokens ascending inside)."""
    emask = e < E
    counts = tl.load(counts_ptr + e, mask=emask, other=0)
    base = tl.cumsum(counts, axis=0) - counts + tl.load(tile_base_ptr + pid * E + e, mask=emask, other=0)
    return base[None, :] + tl.cumsum(hits, axis=0) - hits


@triton.jit
def _fits(kept_ptr, tile_base_ptr, counts_ptr, pid, L, E, max_rows, M: tl.constexpr, BLOCK_L: tl.constexpr,
          E_PAD: tl.constexpr):
    """(token ids, experts, kept, fits, each pair's place among its token's experts) of tile pid."""
    t = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    e = tl.arange(0, E_PAD)
    kept = _kept_tile(kept_ptr, t, L, e, E)
    k = tl.cumsum(kept, axis=1) - kept
    row = _place(kept, pid, e, E, tile_base_ptr, counts_ptr)
    fits = kept * ((row < max_rows) & (k < M)).to(tl.int32)
    return t, e, kept, fits, k


@triton.jit
def rounded_tile_count_kernel(kept_ptr, tile_counts_ptr, L, E, BLOCK_L: tl.constexpr, E_PAD: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    e = tl.arange(0, E_PAD)
    tl.store(tile_counts_ptr + pid * E + e, tl.sum(_kept_tile(kept_ptr, t, L, e, E), axis=0), mask=e < E)


@triton.jit
def rounded_fit_count_kernel(kept_ptr, tile_base_ptr, counts_ptr, fit_counts_ptr, lost_ptr, L, E, max_rows,
                             M: tl.constexpr, BLOCK_L: tl.constexpr, E_PAD: tl.constexpr):
    """Per tile: the pairs that fit, per expert, and how many kept pairs do not (lost[pid])."""
    pid = tl.program_id(0)
    t, e, kept, fits, k = _fits(kept_ptr, tile_base_ptr, counts_ptr, pid, L, E, max_rows, M, BLOCK_L, E_PAD)
    tl.store(fit_counts_ptr + pid * E + e, tl.sum(fits, axis=0), mask=e < E)
    tl.store(lost_ptr + pid, tl.sum(tl.sum(kept - fits, axis=1), axis=0))


@triton.jit
def rounded_place_kernel(kept_ptr, tile_base_ptr, counts_kept_ptr, fit_base_ptr, counts_ptr, offsets_ptr,
                         expert_token_idx_ptr, token_slot_ptr, slot_expert_ptr, L, E, max_rows,
                         M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_L: tl.constexpr, E_PAD: tl.constexpr):
    """The fitting pairs to their rows: expert_token_idx[row] = t, and each token's table of M places (place k:
    the row of its k-th expert that fits, and that expert; the sink row max_rows and expert 0 where there is
    none)."""
    pid = tl.program_id(0)
    t, e, kept, fits, k = _fits(kept_ptr, tile_base_ptr, counts_kept_ptr, pid, L, E, max_rows, M, BLOCK_L, E_PAD)
    emask = e < E
    if pid == 0:
        counts = tl.load(counts_ptr + e, mask=emask, other=0)
        tl.store(offsets_ptr + e, tl.cumsum(counts, axis=0) - counts, mask=emask)
        tl.store(offsets_ptr + E, tl.sum(counts, axis=0))
    row = _place(fits, pid, e, E, fit_base_ptr, counts_ptr)
    tmask = t < L
    fit = fits > 0
    tl.store(expert_token_idx_ptr + row, t[:, None] + 0 * row, mask=fit)
    # each token's table: every place the sink row and expert 0, then each fitting pair's row and expert at its
    # place k, a scatter (the barrier orders a place's two stores); O(M + E) per token
    cols = tl.arange(0, M_PAD)
    table = t.to(tl.int64)[:, None] * M + cols[None, :]
    tmask2 = tmask[:, None] & (cols < M)[None, :]
    tl.store(token_slot_ptr + table, tl.full((BLOCK_L, M_PAD), max_rows, tl.int32), mask=tmask2)
    tl.store(slot_expert_ptr + table, tl.zeros((BLOCK_L, M_PAD), tl.int32), mask=tmask2)
    tl.debug_barrier()
    place = t.to(tl.int64)[:, None] * M + k
    tl.store(token_slot_ptr + place, row, mask=fit)
    tl.store(slot_expert_ptr + place, e[None, :] + 0 * row, mask=fit)
