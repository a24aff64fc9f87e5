"""Triton kernels of MoEBlaze's sort-free, atomic-free routing index build.

Three launches. (1) The dense (token x expert) hit map of one tile of BLOCK_L tokens lives in
registers only; each tile writes its per-expert counts (n_tiles x E int32). (2) A column scan over the
tiles turns them into each tile's first position inside each expert's segment, and the column totals
into the per-expert counts. (3) The placement kernel derives the expert offsets from the counts, scans
its hit map down the columns and writes each (token, k) pair straight to its final slot (picked out of its
expert's column by a gather in registers: at 128 experts 2.6-3.2x faster than a compare and a sum over every
expert, H100). Each slot is written by
exactly one program, so no atomics are needed and the result is deterministic, with tokens ascending
inside each expert. Below them: the same build for a token-rounded routing's (L, E) mask, and token rounding
itself (its kept mask and weights).
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
def _place(hits, pid, e, E, tile_base_ptr, counts_ptr):
    """Each hit's row in expert-major order (experts' segments from their counts, tokens ascending inside): the
    segment's start, plus the tile's first place in it (tile_base, the column scan), plus the hits above it in the
    tile (an exclusive scan down each expert column)."""
    emask = e < E
    counts = tl.load(counts_ptr + e, mask=emask, other=0)
    base = tl.cumsum(counts, axis=0) - counts + tl.load(tile_base_ptr + pid * E + e, mask=emask, other=0)
    return base[None, :] + tl.cumsum(hits, axis=0) - hits


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
    if pid == 0:
        counts = tl.load(expert_counts_ptr + e, mask=emask, other=0)
        tl.store(expert_offsets_ptr + e, tl.cumsum(counts, axis=0) - counts, mask=emask)
        tl.store(expert_offsets_ptr + E, tl.sum(counts, axis=0))
    pos = _place(hits, pid, e, E, tile_base_ptr, expert_counts_ptr)
    tmask = t < L
    for k in tl.static_range(K):
        ek = tl.load(topk_idx_ptr + t * K + k, mask=tmask, other=0).to(tl.int32)
        # each pair's slot: its expert's column of pos, picked out by a gather in registers (not a compare and a sum
        # over every expert)
        slot = tl.reshape(tl.gather(pos, ek[:, None], axis=1), (BLOCK_L,))
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


# Token rounding itself (routing.rounding.round_to_index), from the router's logits and top-k to the kept (L, E) mask
# rounded_index reads, with no sort and no host sync: (1) per token tile, the scores, the token-choice mask (the
# mask's first state), each expert's token-choice count in the tile, and two selection keys per expert column, one
# that ranks its other tokens best first and one that ranks its token-choice pairs worst first; (2) per key row,
# the expert's target count and a radix select of the tokens it adds or drops, applied to the mask; with a bound
# on experts per token, (3) which tokens exceed it and (4) each expert that added a pair to one of them rounds down
# instead. Then the rounded weights, differentiable in the logits and the top-k weights, in one kernel each way.

RULE_CODES = {"nr-f": 0, "up": 1, "down": 2}
SCORING_CODES = {"softmax_topk": 0, "topk_softmax": 1, "sigmoid_topk": 2}


@triton.jit
def _row_scores(logits_ptr, t, L, e, E, SCORING: tl.constexpr):
    """(logits, scores, each row's max logit, each row's sum of exp(logit - max)) of a (BLOCK_L, E_PAD) tile in
    fp32: softmax over the row, or the sigmoid (max 0 and sum 1 there, as past L); padding -inf/0."""
    mask = (t < L)[:, None] & (e < E)[None, :]
    lg = tl.load(logits_ptr + t.to(tl.int64)[:, None] * E + e[None, :], mask=mask, other=float("-inf")).to(tl.float32)
    if SCORING == 2:
        s = tl.where(mask, tl.sigmoid(lg), 0.0)
        m = tl.zeros((t.shape[0],), tl.float32)
        z = m + 1.0
    else:
        m = tl.where(t < L, tl.max(lg, axis=1), 0.0)
        p = tl.where(mask, tl.exp(lg - m[:, None]), 0.0)
        z = tl.where(t < L, tl.sum(p, axis=1), 1.0)
        s = p / z[:, None]
    return lg, s, m, z


@triton.jit
def rounding_keys_kernel(logits_ptr, topk_idx_ptr, keys_ptr, kept_ptr, tile_counts_ptr, L, E,
                         K: tl.constexpr, SCORING: tl.constexpr, BLOCK_L: tl.constexpr, E_PAD: tl.constexpr):
    """keys (E, L) fp32: row e holds expert e's scores, negated at its token-choice pairs, so that it ranks its
    other tokens best first, then its token-choice pairs worst first; kept (L, E) uint8 = the token-choice mask;
    tile_counts (n_tiles, E) its column sums per tile."""
    pid = tl.program_id(0)
    t = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    e = tl.arange(0, E_PAD)
    mask = (t < L)[:, None] & (e < E)[None, :]
    _, s, _, _ = _row_scores(logits_ptr, t, L, e, E, SCORING)
    hits = _tile_hits(topk_idx_ptr, t, L, e, K, BLOCK_L, E_PAD)
    chosen = hits > 0
    tl.store(tile_counts_ptr + pid * E + e, tl.sum(hits, axis=0), mask=e < E)
    tl.store(kept_ptr + t.to(tl.int64)[:, None] * E + e[None, :], chosen.to(tl.uint8), mask=mask)
    # transposed in registers, so that each expert's run of tokens is stored contiguously
    col = e.to(tl.int64)[:, None] * L + t[None, :]
    tl.store(keys_ptr + col, tl.trans(tl.where(chosen, -s, s)), mask=tl.trans(mask))


@triton.jit
def _order_key(key):
    """fp32 keys as uint32 in the same order (negative floats' magnitude bits flipped, then the sign bit)."""
    bits = key.to(tl.int32, bitcast=True)
    return ((bits ^ ((bits >> 31) & 0x7FFFFFFF)) ^ (-2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def _radix_select(keys_ptr, ex, L, rank, kept_ptr, E, sel_ptr, n_sel, IS_DROP: tl.constexpr,
                  WRITE_SEL: tl.constexpr, BLOCK: tl.constexpr, DIGIT: tl.constexpr):
    """The tokens expert ex adds (its `rank` best other tokens) or drops (IS_DROP: rank = its other tokens + the
    token-choice pairs it drops, its worst ones) by a radix select of the rank-th largest key of its row (32 / DIGIT
    passes of DIGIT bits over the row, counts kept per lane until a pass ends; then one pass to count and one to
    write): kept[t, ex] set to 1 or 0 for each, and, with WRITE_SEL, sel[ex, :rank] = the added tokens in token
    order. Ties at the threshold go as the reference's stable sort sends them: the earliest tokens are added first,
    the latest dropped first."""
    keys = keys_ptr + ex.to(tl.int64) * L
    digit = tl.arange(0, 1 << DIGIT)
    prefix = tl.zeros((), tl.uint32)  # the rank-th largest key, DIGIT bits a pass from the top
    for p in tl.static_range(32 // DIGIT):
        cand = prefix + (digit.to(tl.uint32) << (32 - DIGIT * (p + 1)))
        acc = tl.zeros((BLOCK, 1 << DIGIT), tl.int32)
        for t0 in range(0, L, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            v = _order_key(tl.load(keys + t, mask=t < L, other=float("-inf")))
            acc += ((v[:, None] >= cand[None, :]) & (t < L)[:, None]).to(tl.int32)
        cnt = tl.sum(acc, axis=0)
        prefix += tl.max(tl.where(cnt >= rank, digit, 0), axis=0).to(tl.uint32) << (32 - DIGIT * (p + 1))
    gt = tl.zeros((BLOCK,), tl.int32)
    eq = tl.zeros((BLOCK,), tl.int32)
    for t0 in range(0, L, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        v = _order_key(tl.load(keys + t, mask=t < L, other=float("-inf")))
        gt += ((v > prefix) & (t < L)).to(tl.int32)
        eq += ((v == prefix) & (t < L)).to(tl.int32)
    n_eq = tl.sum(eq, axis=0)
    ties = rank - tl.sum(gt, axis=0)  # how many at the threshold are taken: the first, or the last if dropping
    seen_eq = tl.zeros((), tl.int32)
    taken = tl.zeros((), tl.int32)
    for t0 in range(0, L, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        inside = t < L
        v = _order_key(tl.load(keys + t, mask=inside, other=float("-inf")))
        at = ((v == prefix) & inside).to(tl.int32)
        tie_rank = seen_eq + tl.cumsum(at, axis=0)  # 1-based among the ties so far
        if IS_DROP:  # token-choice pairs only (negated scores: the top bit clear)
            take = (((v > prefix) & inside) | ((at > 0) & (tie_rank > n_eq - ties))) & ((v >> 31) == 0)
        else:
            take = ((v > prefix) & inside) | ((at > 0) & (tie_rank <= ties))
        tl.store(kept_ptr + t.to(tl.int64) * E + ex, tl.full((BLOCK,), 0 if IS_DROP else 1, tl.uint8), mask=take)
        if WRITE_SEL:
            pos = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
            tl.store(sel_ptr + ex.to(tl.int64) * n_sel + pos, t, mask=take)
            taken += tl.sum(take.to(tl.int32), axis=0)
        seen_eq += tl.sum(at, axis=0)


@triton.jit
def rounding_select_kernel(keys_ptr, tile_counts_ptr, kept_ptr, sel_ptr, counts_ptr, change_ptr, n_tiles, L, E,
                           tile, n_sel, RULE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr,
                           DIGIT: tl.constexpr):
    """One program per expert: its token-choice count f, its target (the rule of routing.rounding) and change
    c = target - f, then the c best other tokens added (c > 0; recorded in sel[e] for the bound) or the f - target
    worst token-choice pairs dropped (c < 0)."""
    ex = tl.program_id(0)
    f = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for t0 in range(0, n_tiles, BLOCK_T):
        i = t0 + tl.arange(0, BLOCK_T)
        f += tl.load(tile_counts_ptr + i * E + ex, mask=i < n_tiles, other=0)
    f = tl.sum(f, axis=0)
    down = f // tile * tile
    up = (f + tile - 1) // tile * tile
    up = tl.where(up > L, down, up)
    if RULE == 0:
        target = tl.where(up - f < f - down, up, down)
    elif RULE == 1:
        target = up
    else:
        target = down
    change = target - f
    tl.store(counts_ptr + ex, f)
    tl.store(change_ptr + ex, change)
    if change > 0:
        _radix_select(keys_ptr, ex, L, change, kept_ptr, E, sel_ptr, n_sel, False, True, BLOCK, DIGIT)
    elif change < 0:
        _radix_select(keys_ptr, ex, L, L - target, kept_ptr, E, sel_ptr, n_sel, True, False, BLOCK, DIGIT)


@triton.jit
def rounding_over_kernel(kept_ptr, over_ptr, L, E, max_experts, BLOCK_L: tl.constexpr, E_PAD: tl.constexpr):
    """over[t] = 1 where token t keeps more than max_experts experts."""
    t = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    n = tl.sum(_kept_tile(kept_ptr, t, L, tl.arange(0, E_PAD), E), axis=1)
    tl.store(over_ptr + t, (n > max_experts).to(tl.uint8), mask=t < L)


@triton.jit
def rounding_bound_kernel(keys_ptr, sel_ptr, over_ptr, counts_ptr, change_ptr, kept_ptr, L, E, n_sel, tile,
                          SEL_PAD: tl.constexpr, BLOCK: tl.constexpr, DIGIT: tl.constexpr):
    """One program per expert: one that added a pair to a token over the bound undoes its additions and drops its
    f mod tile worst token-choice pairs instead (rounds down)."""
    ex = tl.program_id(0)
    change = tl.load(change_ptr + ex)
    j = tl.arange(0, SEL_PAD)
    add = tl.load(sel_ptr + ex * n_sel + j, mask=j < change, other=0)
    gave = tl.max(tl.load(over_ptr + add, mask=j < change, other=0), axis=0) > 0
    if gave:
        tl.store(kept_ptr + add * E + ex, tl.zeros((SEL_PAD,), tl.uint8), mask=j < change)
        f = tl.load(counts_ptr + ex)
        if f % tile > 0:
            _radix_select(keys_ptr, ex, L, L - f // tile * tile, kept_ptr, E, sel_ptr, n_sel, True, False, BLOCK,
                          DIGIT)


@triton.jit
def _chosen_norm(logits_ptr, topk_idx_ptr, t, L, E, m, z, K: tl.constexpr, SCORING: tl.constexpr):
    """Per token, from the row's max logit m and softmax sum z (_row_scores; softmax_topk's only): (the max that
    _score subtracts, and the normalizer of the chosen pairs' weights): softmax_topk: m, then Σ_k s[t, I_k];
    topk_softmax: max_k l[t, I_k] and Σ_k exp(l[t, I_k] - max); sigmoid_topk: m (unused) and Σ_k σ(l[t, I_k])."""
    tmask = t < L
    row = t.to(tl.int64) * E
    if SCORING == 1:
        m = m * 0.0 + float("-inf")
        for k in tl.static_range(K):
            ek = tl.load(topk_idx_ptr + t * K + k, mask=tmask, other=0)
            m = tl.maximum(m, tl.load(logits_ptr + row + ek, mask=tmask, other=0.0).to(tl.float32))
    norm = m * 0.0
    for k in tl.static_range(K):
        ek = tl.load(topk_idx_ptr + t * K + k, mask=tmask, other=0)
        lk = tl.load(logits_ptr + row + ek, mask=tmask, other=0.0).to(tl.float32)
        norm += _score(lk, m, z, SCORING)
    return m, norm


@triton.jit
def _score(lg, m, z, SCORING: tl.constexpr):
    """A pair's unnormalized score from its logit: exp(l - max) / z (softmax_topk: the softmax score s),
    exp(l - max) (topk_softmax), σ(l) (sigmoid_topk)."""
    if SCORING == 0:
        return tl.exp(lg - m) / z
    elif SCORING == 1:
        return tl.exp(lg - m)
    else:
        return tl.sigmoid(lg)


@triton.jit
def _divisor(norm, SCORING: tl.constexpr, RENORM: tl.constexpr):
    """What an added pair's score is divided by: the token's normalizer (topk_softmax, or renormalized: + 1e-20
    for sigmoid scores, as the router), else 1."""
    if SCORING == 1:
        return norm
    elif RENORM:
        return norm + (1e-20 if SCORING == 2 else 0.0)
    else:
        return norm * 0.0 + 1.0


@triton.jit
def _table(expert_ptr, slot_ptr, t, L, max_rows, M: tl.constexpr, M_PAD: tl.constexpr):
    """(places (BLOCK_L, M_PAD) int64, in range, experts, valid: the place holds a pair) of a token tile's table."""
    j = tl.arange(0, M_PAD)
    inside = (t < L)[:, None] & (j < M)[None, :]
    place = t.to(tl.int64)[:, None] * M + j[None, :]
    ex = tl.load(expert_ptr + place, mask=inside, other=0)
    valid = tl.load(slot_ptr + place, mask=inside, other=max_rows) < max_rows
    return place, inside, ex, valid


@triton.jit
def rounded_weights_kernel(logits_ptr, topk_idx_ptr, topk_w_ptr, expert_ptr, slot_ptr, w_ptr, L, E, max_rows,
                           route_scale, K: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr,
                           SCORING: tl.constexpr, RENORM: tl.constexpr, BLOCK_L: tl.constexpr,
                           E_PAD: tl.constexpr):
    """w (L, M): each place's weight (routing.rounding's convention): a token-choice pair's top-k weight, an added
    pair's route_scale · score / the token's normalizer, 0 where the place holds no pair."""
    t = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    if SCORING == 0:  # only softmax scores need the whole row
        _, _, m, z = _row_scores(logits_ptr, t, L, tl.arange(0, E_PAD), E, SCORING)
    else:
        m = tl.zeros((BLOCK_L,), tl.float32)
        z = m + 1.0
    m, norm = _chosen_norm(logits_ptr, topk_idx_ptr, t, L, E, m, z, K, SCORING)
    place, inside, ex, valid = _table(expert_ptr, slot_ptr, t, L, max_rows, M, M_PAD)
    le = tl.load(logits_ptr + t.to(tl.int64)[:, None] * E + ex, mask=inside, other=0.0).to(tl.float32)
    w = route_scale * (_score(le, m[:, None], z[:, None], SCORING) / _divisor(norm, SCORING, RENORM)[:, None])
    for k in tl.static_range(K):
        ek = tl.load(topk_idx_ptr + t * K + k, mask=t < L, other=-1)
        wk = tl.load(topk_w_ptr + t * K + k, mask=t < L, other=0.0)
        w = tl.where(ex == ek[:, None], wk[:, None], w)
    tl.store(w_ptr + place, tl.where(valid, w, 0.0), mask=inside)


@triton.jit
def rounded_weights_backward_kernel(logits_ptr, topk_idx_ptr, expert_ptr, slot_ptr, w_ptr, dw_ptr, dlogits_ptr,
                                    dtopk_w_ptr, L, E, max_rows, K: tl.constexpr, M: tl.constexpr,
                                    M_PAD: tl.constexpr, SCORING: tl.constexpr, RENORM: tl.constexpr,
                                    BLOCK_L: tl.constexpr, E_PAD: tl.constexpr):
    """dtopk_w (L, K): the gradient of each token-choice pair's place; dlogits (L, E): the added pairs' weights'
    gradient, at their own logit (g·w, times 1 - σ for sigmoid scores) and through the token's normalizer
    (-Σ g·w times the chosen scores' share: the softmax row's scores where not renormalized)."""
    t = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    tmask = t < L
    e = tl.arange(0, E_PAD)
    lg, s, m, z = _row_scores(logits_ptr, t, L, e, E, SCORING)
    m, norm = _chosen_norm(logits_ptr, topk_idx_ptr, t, L, E, m, z, K, SCORING)
    place, inside, ex, valid = _table(expert_ptr, slot_ptr, t, L, max_rows, M, M_PAD)
    dw = tl.load(dw_ptr + place, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + place, mask=inside, other=0.0)
    chosen_place = ex < 0
    for k in tl.static_range(K):
        ek = tl.load(topk_idx_ptr + t * K + k, mask=tmask, other=-1)
        match = (ex == ek[:, None]) & valid
        chosen_place = chosen_place | match
        tl.store(dtopk_w_ptr + t * K + k, tl.sum(tl.where(match, dw, 0.0), axis=1), mask=tmask)
    added = valid & ~chosen_place
    gw = tl.where(added, dw * w, 0.0)
    a = tl.sum(gw, axis=1)
    chosen = _tile_hits(topk_idx_ptr, t, L, e, K, BLOCK_L, E_PAD) > 0
    if SCORING == 0:
        if RENORM:
            dl = -tl.where(chosen, (a / norm)[:, None] * s, 0.0)
        else:
            dl = -a[:, None] * s
    elif SCORING == 1:
        dl = -tl.where(chosen, (a / norm)[:, None] * tl.exp(lg - m[:, None]), 0.0)
    elif RENORM:
        dl = -tl.where(chosen, (a / (norm + 1e-20))[:, None] * (s * (1.0 - s)), 0.0)
    else:
        dl = tl.zeros((BLOCK_L, E_PAD), tl.float32)
    mask = tmask[:, None] & (e < E)[None, :]
    tl.store(dlogits_ptr + t.to(tl.int64)[:, None] * E + e[None, :], dl, mask=mask)
    # each added pair's own term at its expert's column, stored over the above (the barrier orders the two
    # stores): its own derivative g·w (times 1 - σ for sigmoid scores), plus what the row term put there (only
    # softmax scores without renormalization put anything at a column not chosen: -a·s)
    own = gw
    if SCORING == 2 or (SCORING == 0 and not RENORM):
        le = tl.load(logits_ptr + t.to(tl.int64)[:, None] * E + ex, mask=inside, other=0.0).to(tl.float32)
        if SCORING == 2:
            own = gw * (1.0 - tl.sigmoid(le))
        else:
            own = gw - a[:, None] * _score(le, m[:, None], z[:, None], SCORING)
    tl.debug_barrier()
    tl.store(dlogits_ptr + t.to(tl.int64)[:, None] * E + ex, own, mask=added & inside)
