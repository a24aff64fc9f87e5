"""Hopper (sm_90) warp-specialised expert GEMMs in Gluon, by role: common (shims, layouts, the tile walk),
partitions (loaders, MMA and store partitions), up (the SwiGLU up-projection), rows (the row GEMMs, plain and
gathering), fp8 (the row GEMMs on e4m3 with block scales), wgrad (the weight gradients).
Which launches take them is decided in experts.dispatch; the launchers assume operands it accepted."""
from .fp8 import fp8_rows_gemm
from .rows import gathered_rows_gemm, rows_gemm
from .up import up_swiglu
from .wgrad import WGRAD_BLOCKS, weight_grad

GATHER_BLOCK_K = 64  # K of a stage of the gathering kernels: a gathered operand's width must be a multiple

__all__ = ["GATHER_BLOCK_K", "WGRAD_BLOCKS", "fp8_rows_gemm", "gathered_rows_gemm", "rows_gemm", "up_swiglu",
           "weight_grad"]
