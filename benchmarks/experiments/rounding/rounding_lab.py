"""Lab notebook, 2026-11-24. Question: which token tile, warp count and radix digit width should token rounding's keys
and select kernels launch with?
Answer: the keys kernel at half the index's token tile and the weights kernel at a quarter: at the full tile ptxas
spills registers (the keys kernel took 240 µs instead of 19 at config C); the settings are in
moeblaze.routing.rounding.

Token rounding's kernels timed alone on one GPU (CUDA events, 30 calls after a warm-up), at configs C and D
and E 256 (L, E, K): the keys kernel at tile sizes and warp counts, the select kernel at block sizes, warp counts
and radix digit widths (each call after a copy that restores the token-choice mask, timed alone too), and
torch.topk of the same keys for scale. A diagnostic for choosing the launch settings in
moeblaze.routing.rounding; it prints, it writes no result rows.

    python benchmarks/experiments/rounding/rounding_lab.py
"""
import torch

from moeblaze.launch import launch
from moeblaze.routing import route_topk
from moeblaze.routing import triton as rt
from moeblaze.routing.index import dense_tile_size

TILE = 128
KEYS = ((1, 4), (1, 8), (2, 4), (2, 8))  # (tile = dense_tile_size(E) // divisor, warps)
SELECT = ((1024, 16, 4), (1024, 16, 2), (1024, 16, 1), (2048, 16, 2), (512, 8, 2), (1024, 8, 4))  # block, warps, bits


def timed_us(fn, reps: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000


def keys(logits, idx, block_l, warps):
    """(keys, kept, tile counts, tile count) of one keys launch, and its time."""
    (L, E), K = logits.shape, idx.shape[1]
    n_tiles = -(-L // block_l)
    out = (torch.empty(E, L, device="cuda"), torch.empty(L, E, dtype=torch.uint8, device="cuda"),
           torch.empty(n_tiles, E, dtype=torch.int32, device="cuda"))

    def call():
        launch(rt.rounding_keys_kernel, (n_tiles,), logits, idx, *out, L, E, K=K, SCORING=0, BLOCK_L=block_l,
               E_PAD=1 << max(0, (E - 1).bit_length()), num_warps=warps)
    return (*out, n_tiles), timed_us(call)


def one_shape(L: int, E: int, K: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(L, E, device="cuda")
    idx = route_topk(logits, K)[0].contiguous()
    print(f"--- L {L} E {E} K {K}")
    for div, warps in KEYS:
        _, us = keys(logits, idx, dense_tile_size(E) // div, warps)
        print(f"keys    tile {dense_tile_size(E) // div:4d} warps {warps:2d}: {us:7.1f} us")
    (k, kept, counts_t, n_tiles), _ = keys(logits, idx, dense_tile_size(E) // 2, 4)
    kept0 = kept.clone()
    sel = torch.empty(E, TILE - 1, dtype=torch.int32, device="cuda")
    counts, change = (torch.empty(E, dtype=torch.int32, device="cuda") for _ in range(2))
    copy_us = timed_us(lambda: kept.copy_(kept0))
    for block, warps, bits in SELECT:
        def call(block=block, warps=warps, bits=bits):
            kept.copy_(kept0)
            launch(rt.rounding_select_kernel, (E,), k, counts_t, kept, sel, counts, change, n_tiles, L, E, TILE,
                   TILE - 1, RULE=0, BLOCK_T=128, BLOCK=block, DIGIT=bits, num_warps=warps)
        print(f"select  block {block:4d} warps {warps:2d} digit {bits}: {timed_us(call) - copy_us:7.1f} us")
    signed = torch.where(kept0.t() > 0, -k, k)
    print(f"torch.topk of (E, L) keys, k {TILE - 1}: {timed_us(lambda: signed.topk(TILE - 1, dim=1)):7.1f} us")


def main():
    for L, E, K in ((24576, 128, 8), (32768, 128, 8), (16384, 256, 4)):
        one_shape(L, E, K)


if __name__ == "__main__":
    main()
