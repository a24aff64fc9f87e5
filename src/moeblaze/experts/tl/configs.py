"""Launch configurations of the tl kernels: the autotuner's candidates per kernel, their pre-hooks (which give
the host tensor descriptors their block shapes) and the fixed constants the kernels share.

Rows per tile (BLOCK_M, in experts.schedule) are fixed because the tile schedule is built for them; the rest
is autotuned per shape on GPUs. Under the CPU interpreter one small config per kernel is used.
"""
import triton

from ...env import INTERPRET

# The dH kernel (down_bwd) writes one router-gradient partial per DS_BLOCK columns (its BLOCK_N is a multiple).
DS_BLOCK = 16 if INTERPRET else 64
GROUP_M = 8  # row tiles that sweep the columns together, so a weight tile is reused from L2


def _configs(keys, gpu, interp, pre_hook=None):
    """Autotune configs from tuples (*values of keys, num_warps, num_stages); one small config under the
    interpreter."""
    def config(c):
        return triton.Config(dict(zip(keys, c[:-2])), num_warps=c[-2], num_stages=c[-1], pre_hook=pre_hook)
    return [config(interp)] if INTERPRET else [config(c) for c in gpu]


def _set_block(desc, shape):
    """Give a host tensor descriptor (a pointer otherwise: nothing to do) its block shape."""
    if hasattr(desc, "block_shape"):
        desc.block_shape = list(shape)


def _rows_blocks(nargs):
    _set_block(nargs["a_desc"], (nargs["BLOCK_M"], nargs["BLOCK_K"]))
    _set_block(nargs["b_desc"], (nargs["BLOCK_N"], nargs["BLOCK_K"]) if nargs["B_KMAJOR"]
               else (nargs["BLOCK_K"], nargs["BLOCK_N"]))


def _dh_blocks(nargs):
    _set_block(nargs["w2_desc"], (nargs["BLOCK_K"], nargs["BLOCK_N"]))


# row GEMMs (down-projection, dX~): (BLOCK_N, BLOCK_K, PERSISTENT, num_warps, num_stages)
ROWS_CONFIGS = _configs(("BLOCK_N", "BLOCK_K", "PERSISTENT"),
                        [(128, 64, 0, 8, 3), (128, 64, 0, 4, 4), (256, 64, 0, 8, 3), (256, 64, 0, 8, 4),
                         (128, 128, 0, 8, 3), (128, 64, 1, 8, 3), (256, 64, 1, 8, 3), (128, 64, 1, 8, 4)],
                        (32, 32, 1, 4, 1), pre_hook=_rows_blocks)


def _up_blocks(nargs):
    _set_block(nargs["w1_desc"], (nargs["BLOCK_N"], nargs["BLOCK_K"]))


# up-projection: (BLOCK_N, BLOCK_K, TWO_DOTS, num_warps, num_stages); gated, the MMA is BLOCK_M x 2·BLOCK_N
# (gate and up columns together) or two BLOCK_M x BLOCK_N ones (TWO_DOTS). 64-column 3-stage tiles, two
# programs per multiprocessor, were 5-25% slower at B and E, so they are not listed.
UP_CONFIGS = _configs(("BLOCK_N", "BLOCK_K", "TWO_DOTS"),
                      [(128, 64, 0, 8, 3), (64, 64, 0, 4, 4), (128, 64, 0, 8, 4), (64, 64, 0, 8, 4),
                       (128, 64, 1, 8, 3), (128, 64, 1, 8, 4), (64, 64, 1, 4, 4)],
                      (16, 32, 1, 4, 1), pre_hook=_up_blocks)


# dH: (BLOCK_N, BLOCK_K, PREFETCH_H, EPI_SPLIT, num_warps, num_stages); BLOCK_N / EPI_SPLIT a multiple of
# DS_BLOCK. Slower at every config measured, so not listed: persistent programs (the next tile's loads
# overlapping this one's epilogue, 3.9-5.8 against 3.0 ms at E) and 4-warp tiles for two programs per
# multiprocessor (they spill ~400 registers: 3.7 against 2.8 ms at E).
DH_CONFIGS = _configs(("BLOCK_N", "BLOCK_K", "PREFETCH_H", "EPI_SPLIT"),
                      [(256, 64, 0, 4, 8, 4), (256, 64, 0, 4, 8, 3), (128, 64, 0, 2, 8, 4), (128, 64, 0, 2, 8, 3),
                       (128, 64, 1, 2, 8, 4), (64, 64, 1, 1, 8, 3)],
                      (32, 32, 0, 2, 4, 1), pre_hook=_dh_blocks)


def _dense_block(nargs):
    _set_block(nargs["dense_desc"], (nargs["BLOCK_K"], nargs["BLOCK_P"] if nargs["GATHER_P"] else nargs["BLOCK_N"]))


# weight gradients: (BLOCK_N, BLOCK_P, BLOCK_K, SWAP, num_warps, num_stages)
WGRAD_CONFIGS = _configs(("BLOCK_N", "BLOCK_P", "BLOCK_K", "SWAP"),
                         [(128, 128, 32, 0, 4, 4), (128, 128, 64, 0, 8, 3), (128, 256, 64, 0, 8, 3),
                          (128, 128, 32, 1, 4, 4), (128, 128, 64, 1, 8, 3), (256, 128, 64, 1, 8, 3),
                          (128, 256, 64, 0, 8, 4)],
                         (32, 32, 32, 1, 4, 1), pre_hook=_dense_block)


PRE_HOOKS = {"up": _up_blocks, "rows": _rows_blocks, "down_bwd": _dh_blocks, "weight_grad": _dense_block}


def pinned(kernel: str, values: dict, num_warps: int = 4, num_stages: int = 1) -> triton.Config:
    """One config of a tuned kernel ("up", "rows", "down_bwd", "weight_grad") with that kernel's pre-hook: a list
    of one such config makes the autotuner launch it without benchmarking (tests force every code path so)."""
    return triton.Config(values, num_warps=num_warps, num_stages=num_stages, pre_hook=PRE_HOOKS[kernel])
