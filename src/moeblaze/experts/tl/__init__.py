"""The portable Triton (tl) expert kernels: every GPU Triton supports, and the CPU under the interpreter.
common (jit helpers), configs (autotune candidates), forward (up, rows, combine), backward (down_bwd, act_bwd,
weight gradients), launchers (the host side)."""
from .launchers import TUNED_KERNELS, act_bwd, combine, dh_quantizable, down_bwd, rows_gemm, up, weight_grad

__all__ = ["TUNED_KERNELS", "act_bwd", "combine", "dh_quantizable", "down_bwd", "rows_gemm", "up", "weight_grad"]
