"""Token rounding (SonicMoE, arXiv 2512.14080 §5.2): after the token-choice top-k, every expert's token count is
moved to a multiple of the GEMM's row tile M, so that no tile is partly empty. Training only: evaluation routes
plain top-k.

For each expert e with f_e token-choice pairs, a target f'_e, a multiple of M (never above the L tokens):
  "nr-f" (default)  the nearest multiple: up iff ⌈f_e⌉ − f_e < f_e − ⌊f_e⌋ (ties down)
  "up"              ⌈f_e⌉ (rounded down instead where that exceeds L)
  "down"            ⌊f_e⌋ (token dropping)
Each expert then keeps the f'_e tokens that rank first in its column of S', where S' = S − 1 except at the token's
own top-k choices, S'[t, I_topk] = S[t, I_topk] (S: the router's scores in [0, 1]): its token-choice pairs before
any other, each group by score. Rounding down drops an expert's lowest-scored token-choice pairs; rounding up adds
its highest-scored other tokens. Every expert moves by less than one tile; one with f_e ≤ M/2 under "nr-f" gets
nothing. So the number of experts per token varies, and with max_experts it stays bounded: where the additions would
give a token more than max_experts experts (a token that scores high everywhere, as sigmoid routers allow), every
expert that added a pair to such a token rounds down instead. Dropping never adds a pair, so after that one pass
no token exceeds the bound (each over-bound token keeps only its own top-k pairs, K ≤ max_experts), every count is
still a multiple of M, and nothing syncs with the host.

Weights: a kept token-choice pair keeps its top-k weight. An added pair (t, e) gets the weight the router would
have given e among t's choices, with t's own normalizer: route_scale · s[t, e] / Σ_k s[t, I_k] where the router
renormalizes ("softmax_topk", "sigmoid_topk"), route_scale · s[t, e] where it doesn't, and
route_scale · exp(l[t, e]) / Σ_k exp(l[t, I_k]) for "topk_softmax". A dropped pair is dropped with its weight:
the others are not renormalized (the expert's output for that token is simply absent, as under token dropping).
The balancing losses use the counts before rounding.

round_tokens is the reference (dense (L, E) masks, a sort per expert column), what the rest is checked against;
round_tokens_fast gives the same result without sorting: an expert moves by less than a tile, so it only ever
drops some of its M − 1 lowest-scored token-choice pairs or adds some of its M − 1 best other tokens, two
column-wise top-(M − 1) selections (ties between equal scores may then resolve differently from the reference's
stable order). rounded_index turns a rounding into the kernels' routing index; round_to_index does both at once in
kernels, ties as the reference (what MoELayer runs).
Memory: (L, E) scores and masks, transient (as the router's own (L, E) logits).
"""
from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch

from ..args import check_int
from ..configs import RULES, RoundingConfig, RouterConfig  # noqa: F401  (RULES re-exported by routing)
from ..env import INTERPRET
from .checks import check_topk_idx, check_topk_weights, fail_if

class RoundedRouting(NamedTuple):
    kept_LE: torch.Tensor  # (L, E) bool: the pairs every expert computes
    weights_LE: torch.Tensor  # (L, E) fp32: their weights (0 elsewhere), differentiable in the logits
    counts_E: torch.Tensor  # (E,) int64: kept tokens per expert, each a multiple of the tile


def rounded_counts(counts_E: torch.Tensor, tile: int, rule: str = "nr-f", num_tokens: int | None = None
                   ) -> torch.Tensor:
    """Each expert's target count f'_e (see the module header)."""
    RoundingConfig(rule, tile)
    f = counts_E.to(torch.int64)
    down = f // tile * tile
    up = -(-f // tile) * tile
    if num_tokens is not None:
        up = torch.where(up > num_tokens, down, up)
    if rule == "up":
        return up
    if rule == "down":
        return down
    return torch.where(up - f < f - down, up, down)


def _scores(logits_LE: torch.Tensor, scoring: str) -> torch.Tensor:
    logits_LE = logits_LE.float()
    return logits_LE.sigmoid() if scoring == "sigmoid_topk" else logits_LE.softmax(dim=-1)


def _check(logits_LE, topk_idx_LK, topk_weights_LK, tile, rule, scoring, renormalize, route_scale, max_experts,
           stacklevel: int, check_values: bool = True) -> None:
    """The arguments every rounding entry point checks, one validator for the three (shapes, types and options;
    with check_values, the ids (in range, no expert twice in a token), the weights and the logits (finite) too, as
    device-side asserts on a GPU), and the warning below two tiles of tokens per expert."""
    RouterConfig(scoring=scoring, renormalize=renormalize, route_scale=route_scale)
    RoundingConfig(rule, tile)
    if not isinstance(logits_LE, torch.Tensor) or not logits_LE.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {_describe(logits_LE)}")
    if logits_LE.dim() != 2:
        raise ValueError(f"logits must have shape (L, E), got shape {tuple(logits_LE.shape)}")
    L, E = logits_LE.shape
    check_topk_idx(topk_idx_LK, E, check_values)
    check_topk_weights(topk_weights_LK, topk_idx_LK, check_values)
    if check_values and logits_LE.numel():
        fail_if(~torch.isfinite(logits_LE).all(), "token rounding: the logits hold NaN or Inf")
    if topk_idx_LK.shape[0] != L or topk_idx_LK.device != logits_LE.device:
        raise ValueError(f"topk_idx {tuple(topk_idx_LK.shape)} on {topk_idx_LK.device} must route the logits' "
                         f"{L} tokens on {logits_LE.device}")
    K = topk_idx_LK.shape[1]
    if max_experts is not None and check_int("max_experts", max_experts) < K:
        raise ValueError(f"max_experts must be at least top_k ({K}), got {max_experts}")
    if L * K < 2 * tile * E:
        avg = L * K / E
        if rule == "up" and L < tile:  # an expert can't hold a tile of distinct tokens: each rounds down to 0
            what = (f"with {L} tokens no expert can fill a tile, so every expert rounds down to 0 and every pair is "
                    "dropped: the layer computes nothing")
        elif (rule == "nr-f" and avg < tile / 2) or (rule == "down" and avg < tile):
            what = (f"an expert with fewer than {tile // 2 if rule == 'nr-f' else tile} pairs rounds down to 0, so at "
                    "this average most pairs (all, where every expert is below it) are dropped")
        else:
            what = "rounding moves each expert by up to a tile, which changes the routing a lot here"
        warnings.warn(f"token rounding with {avg:.0f} tokens per expert on average, fewer than 2 tiles of {tile}: "
                      f"{what} (SonicMoE measured worse quality at 1 tile; a smaller tile or a larger batch keeps "
                      "more)", stacklevel=stacklevel)


def _describe(t) -> str:
    return f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _round(logits_LE, topk_idx_LK, topk_weights_LK, tile, rule, scoring, renormalize, route_scale,
           keep, max_experts) -> RoundedRouting:
    """What the roundings share, once their caller has checked the arguments: the scores, the counts and targets,
    the bound on experts per token and the weight convention; keep(scores (L, E) detached, chosen (L, E), counts
    (E,), targets (a tuple of (E,))) -> a kept (L, E) mask per target."""
    L, E = logits_LE.shape
    idx = topk_idx_LK.long()
    s = _scores(logits_LE, scoring)
    chosen = torch.zeros(L, E, dtype=torch.bool, device=s.device).scatter_(1, idx, True)
    counts = chosen.sum(0)
    target = rounded_counts(counts, tile, rule, L)
    if max_experts is None or max_experts >= E or rule == "down":
        kept = keep(s.detach(), chosen, counts, (target,))[0]
    else:  # experts that added a pair to a token over the bound round down instead (see the module header)
        kept, kept_down = keep(s.detach(), chosen, counts, (target, counts // tile * tile))
        over_L = kept.sum(1) > max_experts
        gave_E = (kept & ~chosen & over_L[:, None]).any(0)
        kept = torch.where(gave_E[None, :], kept_down, kept)
    # weights: the token's top-k weights where chosen, the router's weight with the token's normalizer elsewhere
    if scoring == "topk_softmax":
        lf = logits_LE.float()
        chosen_l = lf.gather(1, idx)
        m = chosen_l.max(dim=1, keepdim=True).values
        other = torch.exp(lf - m) / torch.exp(chosen_l - m).sum(dim=1, keepdim=True)
    elif renormalize:
        other = s / (s.gather(1, idx).sum(dim=1, keepdim=True) + (1e-20 if scoring == "sigmoid_topk" else 0.0))
    else:
        other = s
    other = other * route_scale
    w = torch.zeros(L, E, dtype=torch.float32, device=s.device).scatter(1, idx, topk_weights_LK.float())
    w = torch.where(chosen, w, other)
    return RoundedRouting(kept, torch.where(kept, w, torch.zeros_like(w)), kept.sum(0))


def _keep_by_sort(s, chosen, counts, targets):
    """Each expert's first target[e] tokens of its column of S' (token-choice pairs first), by a stable sort."""
    L, E = s.shape
    order = torch.where(chosen, s, s - 1).argsort(dim=0, descending=True, stable=True)  # per expert, best first
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(L, device=s.device)[:, None].expand(L, E))
    return tuple(rank < target[None, :] for target in targets)


def _keep_by_topk(s, chosen, counts, targets, k: int):
    """The same through two column-wise top-k selections (k = tile - 1), made once for every target: an expert
    drops some of its worst token-choice pairs or adds some of its best other tokens, fewer than a tile either
    way."""
    L, E = s.shape
    k = min(k, L)
    if k == 0:
        return tuple(chosen.clone() for _ in targets)
    j = torch.arange(k, device=s.device)[:, None]
    # each expert's column as a contiguous row of the (E, L) transpose: a selection along the outer dimension
    # of the tall (L, E) matrix reads it strided, one slice per expert
    s_EL, chosen_EL = s.t().contiguous(), chosen.t().contiguous()
    worst = torch.where(chosen_EL, s_EL, float("inf")).topk(k, dim=1, largest=False).indices.t()  # (k, E)
    best = torch.where(chosen_EL, float("-inf"), s_EL).topk(k, dim=1).indices.t()
    cols = torch.arange(E, device=s.device)[None, :].expand(k, E)
    masks = []
    for target in targets:
        change = target - counts  # (E,): < 0 drop, > 0 add, |change| < tile
        kept = chosen.clone()
        kept[worst, cols] = torch.where(j < -change[None, :], False, kept[worst, cols])
        kept[best, cols] = torch.where(j < change[None, :], True, kept[best, cols])
        masks.append(kept)
    return tuple(masks)


def round_tokens(logits_LE: torch.Tensor, topk_idx_LK: torch.Tensor, topk_weights_LK: torch.Tensor, tile: int,
                 rule: str = "nr-f", scoring: str = "softmax_topk", renormalize: bool = True,
                 route_scale: float = 1.0, *, max_experts: int | None = None) -> RoundedRouting:
    """The token-rounded routing of a token-choice top-k (topk_idx, topk_weights from `logits` by the same
    scoring, renormalize and route_scale; see moeblaze.routing.route_topk); at most max_experts experts per token
    where given (see the module header)."""
    _check(logits_LE, topk_idx_LK, topk_weights_LK, tile, rule, scoring, renormalize, route_scale, max_experts,
           stacklevel=3)
    return _round(logits_LE, topk_idx_LK, topk_weights_LK, tile, rule, scoring, renormalize, route_scale,
                  _keep_by_sort, max_experts)


def round_tokens_fast(logits_LE: torch.Tensor, topk_idx_LK: torch.Tensor, topk_weights_LK: torch.Tensor,
                      tile: int, rule: str = "nr-f", scoring: str = "softmax_topk", renormalize: bool = True,
                      route_scale: float = 1.0, *, max_experts: int | None = None) -> RoundedRouting:
    """round_tokens's result through two column-wise top-(tile − 1) selections instead of a sort (see the module
    header)."""
    _check(logits_LE, topk_idx_LK, topk_weights_LK, tile, rule, scoring, renormalize, route_scale, max_experts,
           stacklevel=3)
    return _round(logits_LE, topk_idx_LK, topk_weights_LK, tile, rule, scoring, renormalize, route_scale,
                  functools.partial(_keep_by_topk, k=tile - 1), max_experts)


def default_max_experts(num_experts: int, top_k: int) -> int:
    """The bound on experts per token MoELayer gives a rounding by default: min(E, 4K)."""
    return min(num_experts, 4 * top_k)


def rounded_rows_bound(num_tokens: int, top_k: int, num_experts: int, tile: int, rule: str) -> int:
    """A bound on the pairs a rounding under `rule` keeps, for rounded_index's static row buffer: L·K plus each
    expert's largest rise (under half a tile for "nr-f", under a tile for "up", none for "down"), at most L·E."""
    rise = {"nr-f": -(-tile // 2), "up": tile - 1, "down": 0}[rule]
    return min(num_tokens * top_k + num_experts * rise, num_tokens * num_experts)


def rounded_index(kept_LE: torch.Tensor, weights_LE: torch.Tensor, max_experts: int, max_rows: int):
    """(RoutingIndex, weights (L, max_experts) fp32, overflow) of a token-rounded routing for the kernels, with no
    host sync and no sort. Rows are expert-major, tokens ascending inside each expert, in a buffer of max_rows + 1
    rows of static size (max_rows: the caller's bound on the kept pairs); the rows past the kept pairs are a
    dropped tail (never computed, combined as zero, no gradient), and every empty place of a token's
    (max_experts)-wide table points to the last row, which is always in that tail. overflow (a bool tensor): the
    kept pairs exceed max_rows, or a token has more than max_experts experts; what does not fit is left out, and
    the caller raises or reruns with larger bounds. O(L·E) int64 transient in torch; on GPUs (and under the
    interpreter) five launches of routing/triton.py's kernels and a gather of the weights instead (about 45
    torch ops above), with the same result, O(L / tile · E) int32 transient."""
    if kept_LE.shape[0] > 0 and (kept_LE.is_cuda or INTERPRET):
        return _rounded_index_triton(kept_LE, weights_LE, max_experts, max_rows)
    return _rounded_index_torch(kept_LE, weights_LE, max_experts, max_rows)


def _rounded_index_torch(kept_LE, weights_LE, max_experts: int, max_rows: int):
    """rounded_index in torch ops (CPU tensors, and the contract the kernels are checked against)."""
    from .index import RoutingIndex

    L, E = kept_LE.shape
    R, dev, i32 = max_rows + 1, kept_LE.device, torch.int32
    # The scans along an expert's tokens run on the (E, L) transpose, where they are the inner dimension: torch's
    # scan over the outer dimension of a tall (L, E) tensor is sequential in L (12 ms at L 24576, E 128 on an H200).
    kept_EL = kept_LE.t().contiguous()
    k_EL = kept_LE.cumsum(1, dtype=i32).sub_(1).t()  # each pair's place among its token's experts
    counts = kept_EL.sum(1, dtype=i32)
    row_EL = kept_EL.cumsum(1, dtype=i32).sub_(1).add_((counts.cumsum(0, dtype=i32) - counts)[:, None])
    fits_EL = kept_EL & (row_EL < max_rows) & (k_EL < max_experts)
    overflow = (kept_EL & ~fits_EL).any()
    counts = fits_EL.sum(1, dtype=i32)
    offsets = torch.zeros(E + 1, dtype=i32, device=dev)
    offsets[1:] = counts.cumsum(0, dtype=i32)
    row_EL = fits_EL.cumsum(1, dtype=i32).sub_(1).add_(offsets[:-1, None])  # again, over what fits
    sink = torch.full_like(row_EL, R - 1)
    to_row = torch.where(fits_EL, row_EL, sink).long()
    eti = torch.zeros(R, dtype=i32, device=dev)
    tokens = torch.where(fits_EL, torch.arange(L, dtype=i32, device=dev)[None, :], 0)
    eti.scatter_(0, to_row.flatten(), tokens.flatten())
    eti[R - 1] = 0
    fits, col = fits_EL.t(), torch.where(fits_EL, k_EL, max_experts).t().long()  # one more column takes what
    slot = torch.full((L, max_experts + 1), R - 1, dtype=torch.int64, device=dev)  # does not fit, then is cut off
    slot.scatter_(1, col, to_row.t())
    w = torch.zeros(L, max_experts + 1, dtype=torch.float32, device=dev)
    w = w.scatter(1, col, torch.where(fits, weights_LE.float(), 0.0))
    index = RoutingIndex(counts, offsets, eti, slot[:, :max_experts].int().contiguous(), dropped=True)
    return index, w[:, :max_experts], overflow


def _rounded_index_triton(kept_LE, weights_LE, max_experts: int, max_rows: int):
    """rounded_index in five launches (_rounded_place_triton); each place's weight gathered from weights_LE."""
    index, expert, lost = _rounded_place_triton(kept_LE, max_experts, max_rows)
    # the weights by a gather, so that they stay differentiable in weights_LE (the router's logits)
    w = torch.where(index.token_slot < max_rows, weights_LE.float().gather(1, expert.long()), 0.0)
    return index, w, lost.any()


def _rounded_place_triton(kept_LE, max_experts: int, max_rows: int):
    """(RoutingIndex, each place's expert (L, max_experts) int32, pairs left out per tile) of a kept mask (bool or
    uint8) in five launches: kept pairs counted per tile and scanned, the fitting ones counted and scanned, then
    placed (routing/triton.py)."""
    from ..launch import launch
    from .index import RoutingIndex, _next_pow2, dense_tile_size
    from .triton import (rounded_fit_count_kernel, rounded_place_kernel, rounded_tile_count_kernel,
                         routing_tile_scan_kernel)

    L, E = kept_LE.shape
    dev, i32 = kept_LE.device, torch.int32
    kept = kept_LE.contiguous()
    e_pad, block_l = _next_pow2(E), dense_tile_size(E)
    n_tiles = -(-L // block_l)
    block_e = min(e_pad, 32)
    scan = dict(BLOCK_T=max(16, 4096 // block_e), BLOCK_E=block_e)
    tiles = dict(BLOCK_L=block_l, E_PAD=e_pad)
    tile_base, fit_base = (torch.empty(n_tiles, E, dtype=i32, device=dev) for _ in range(2))
    counts_kept, counts = (torch.empty(E, dtype=i32, device=dev) for _ in range(2))
    lost = torch.empty(n_tiles, dtype=i32, device=dev)
    launch(rounded_tile_count_kernel, (n_tiles,), kept, tile_base, L, E, **tiles)
    launch(routing_tile_scan_kernel, (-(-E // block_e),), tile_base, counts_kept, n_tiles, E, **scan)
    launch(rounded_fit_count_kernel, (n_tiles,), kept, tile_base, counts_kept, fit_base, lost, L, E, max_rows,
           M=max_experts, **tiles)
    launch(routing_tile_scan_kernel, (-(-E // block_e),), fit_base, counts, n_tiles, E, **scan)
    offsets = torch.empty(E + 1, dtype=i32, device=dev)
    eti = torch.zeros(max_rows + 1, dtype=i32, device=dev)
    slot, expert = (torch.empty(L, max_experts, dtype=i32, device=dev) for _ in range(2))
    launch(rounded_place_kernel, (n_tiles,), kept, tile_base, counts_kept, fit_base, counts, offsets, eti, slot,
           expert, L, E, max_rows, M=max_experts, M_PAD=_next_pow2(max_experts), **tiles)
    return RoutingIndex(counts, offsets, eti, slot, dropped=True), expert, lost


def round_to_index(logits_LE: torch.Tensor, topk_idx_LK: torch.Tensor, topk_weights_LK: torch.Tensor, tile: int,
                   rule: str = "nr-f", scoring: str = "softmax_topk", renormalize: bool = True,
                   route_scale: float = 1.0, *, max_experts: int | None = None, max_rows: int | None = None,
                   check: bool = True):
    """Token rounding straight to the kernels' routing index: rounded_index(round_tokens(...)) with the bound
    max_experts (default default_max_experts(E, K)) and a row buffer of max_rows (default rounded_rows_bound, which
    the rounding never exceeds), the same (RoutingIndex, weights (L, max_experts) fp32,
    overflow), ties included, the weights to fp32 rounding. On GPUs (and under the
    interpreter) without (L, E) torch ops: routing/triton.py's rounding kernels write the kept (L, E) mask (a
    radix select per expert instead of a sort), rounded_index's kernels place it, and the weights come from one
    kernel each way, differentiable in the logits and the top-k weights: 8 to 10 launches in forward and 1 in
    backward, against about 80 torch ops and their backward for round_tokens_fast then rounded_index, which is
    what it runs on CPU tensors (ties there as round_tokens_fast's top-k breaks them). Transient: the (E, L) fp32
    selection keys and the (L, E) uint8 mask, about as much as the router's (L, E) scores. The kernels' token
    tiles are a half (keys) and a quarter (weights) of the index's: at the full tile ptxas spills registers (the
    keys kernel took 240 µs instead of 19 at config C, benchmarks/experiments/rounding/rounding_lab.py).
    check=False skips the checks of the ids' and weights' values (a router's own output, as MoELayer passes it).

    Args:
        logits_LE: (L, E) float logits of the router that chose topk_idx.
        topk_idx_LK, topk_weights_LK: (L, K) int ids and float weights of that router.
        tile: every expert's count is rounded to a multiple of it.
        rule: "nr-f", "up" or "down".
        scoring, renormalize, route_scale: the router's (moeblaze.RouterConfig's fields), for added pairs' weights.
        max_experts: at most this many experts per token, >= K (None: min(E, 4K)).
        max_rows: the index's row buffer (None: the bound the rounding never exceeds).
        check: check the ids' and weights' values.

    Returns:
        (RoutingIndex, weights (L, max_experts) fp32 in the index's table layout, overflow: a bool tensor).
    """
    _check(logits_LE, topk_idx_LK, topk_weights_LK, tile, rule, scoring, renormalize, route_scale, max_experts,
           stacklevel=3, check_values=check)
    (L, E), K = logits_LE.shape, topk_idx_LK.shape[1]
    if max_experts is None:
        max_experts = default_max_experts(E, K)
    if max_rows is None:
        max_rows = rounded_rows_bound(L, K, E, tile, rule)
    check_int("max_experts", max_experts)
    check_int("max_rows", max_rows, minimum=0)
    if logits_LE.shape[0] == 0 or not (logits_LE.is_cuda or INTERPRET):
        rr = _round(logits_LE, topk_idx_LK, topk_weights_LK, tile, rule, scoring, renormalize, route_scale,
                    functools.partial(_keep_by_topk, k=tile - 1), max_experts)
        return rounded_index(rr.kept_LE, rr.weights_LE, max_experts, max_rows)
    idx = topk_idx_LK.to(torch.int32).contiguous()
    kept = _kept_triton(logits_LE.detach().contiguous(), idx, tile, rule, scoring, max_experts)
    index, expert, lost = _rounded_place_triton(kept, max_experts, max_rows)
    w = _RoundedWeights.apply(logits_LE, topk_weights_LK, idx, expert, index.token_slot, max_rows, scoring,
                              renormalize, route_scale)
    return index, w, lost.any()


def _kept_triton(logits_LE, idx_LK, tile: int, rule: str, scoring: str, max_experts: int) -> torch.Tensor:
    """The kept (L, E) uint8 mask of round_tokens (ties included) in 2 launches, 4 where the bound on experts per
    token can bind (routing/triton.py)."""
    from ..launch import launch
    from .index import _next_pow2, dense_tile_size
    from .triton import (RULE_CODES, SCORING_CODES, rounding_bound_kernel, rounding_keys_kernel,
                         rounding_over_kernel, rounding_select_kernel)

    (L, E), K, dev = logits_LE.shape, idx_LK.shape[1], logits_LE.device
    tiles = dict(BLOCK_L=dense_tile_size(E) // 2, E_PAD=_next_pow2(E))
    n_tiles = -(-L // tiles["BLOCK_L"])
    keys = torch.empty(E, L, dtype=torch.float32, device=dev)
    kept = torch.empty(L, E, dtype=torch.uint8, device=dev)
    tile_counts = torch.empty(n_tiles, E, dtype=torch.int32, device=dev)
    launch(rounding_keys_kernel, (n_tiles,), logits_LE, idx_LK, keys, kept, tile_counts, L, E, K=K,
           SCORING=SCORING_CODES[scoring], **tiles)
    n_sel = min(tile - 1, L)
    if n_sel == 0:  # a tile of 1: every count is already a multiple
        return kept
    sel = torch.empty(E, n_sel, dtype=torch.int32, device=dev)  # each rising expert's added tokens, first c used
    counts, change = (torch.empty(E, dtype=torch.int32, device=dev) for _ in range(2))
    select = dict(BLOCK=2048, DIGIT=2, num_warps=16)  # the fastest of a sweep at configs C and D, E 256
    launch(rounding_select_kernel, (E,), keys, tile_counts, kept, sel, counts, change, n_tiles, L, E, tile,
           n_sel, RULE=RULE_CODES[rule], BLOCK_T=128, **select)
    if max_experts < E and rule != "down":  # experts that added a pair to a token over the bound round down
        over = torch.empty(L, dtype=torch.uint8, device=dev)
        launch(rounding_over_kernel, (n_tiles,), kept, over, L, E, max_experts, **tiles)
        launch(rounding_bound_kernel, (E,), keys, sel, over, counts, change, kept, L, E, n_sel, tile,
               SEL_PAD=_next_pow2(n_sel), **select)
    return kept


class _RoundedWeights(torch.autograd.Function):
    """Each place's weight (L, M) from the logits and the top-k weights (the module header's convention), one
    kernel each way."""

    @staticmethod
    def forward(ctx, logits_LE, topk_weights_LK, idx_LK, expert_LM, slot_LM, max_rows, scoring, renormalize,
                route_scale):
        from ..launch import launch
        from .index import _next_pow2, dense_tile_size
        from .triton import SCORING_CODES, rounded_weights_kernel

        (L, E), (K, M) = logits_LE.shape, (idx_LK.shape[1], expert_LM.shape[1])
        logits = logits_LE.detach().contiguous()
        meta = dict(K=K, M=M, M_PAD=_next_pow2(M), SCORING=SCORING_CODES[scoring], RENORM=bool(renormalize),
                    BLOCK_L=dense_tile_size(max(E, M)) // 4, E_PAD=_next_pow2(E))  # a quarter: no spills
        w = torch.empty(L, M, dtype=torch.float32, device=logits.device)
        launch(rounded_weights_kernel, (-(-L // meta["BLOCK_L"]),), logits, idx_LK,
               topk_weights_LK.detach().float().contiguous(), expert_LM, slot_LM, w, L, E, max_rows,
               float(route_scale), **meta)
        ctx.save_for_backward(logits, idx_LK, expert_LM, slot_LM, w)
        ctx.meta, ctx.max_rows, ctx.dtypes = meta, max_rows, (logits_LE.dtype, topk_weights_LK.dtype)
        return w

    @staticmethod
    def backward(ctx, dw_LM):
        from ..launch import launch
        from .triton import rounded_weights_backward_kernel

        logits, idx, expert, slot, w = ctx.saved_tensors
        (L, E), K = logits.shape, idx.shape[1]
        dlogits = torch.empty(L, E, dtype=torch.float32, device=logits.device)
        dtopk = torch.empty(L, K, dtype=torch.float32, device=logits.device)
        launch(rounded_weights_backward_kernel, (-(-L // ctx.meta["BLOCK_L"]),), logits, idx, expert, slot, w,
               dw_LM.contiguous(), dlogits, dtopk, L, E, ctx.max_rows, **ctx.meta)
        return dlogits.to(ctx.dtypes[0]), dtopk.to(ctx.dtypes[1]), None, None, None, None, None, None, None
