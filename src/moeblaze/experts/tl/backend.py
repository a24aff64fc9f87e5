"""The tl kernels as a kernel backend (experts.backends): every stage on every GPU Triton supports and under the
CPU interpreter, so it takes every launch (the fallback of the others). W1 in two parts is concatenated per call
(a transient of W1's size) and dW1 copied out of a whole one (the same tiles as for one W1: the same bits).
Memory: each stage allocates its outputs only (and those transients)."""
from __future__ import annotations

import torch

from .. import quant
from ..schedule import whole_w1
from . import launchers
from .fp8 import fp8_rows_gemm


def _takes(*_args, **_kwargs) -> bool:
    return True


class TlBackend:
    name = "tl"
    needs = "a GPU Triton supports, or Triton's CPU interpreter"
    takes_up = takes_down = takes_dx_rows = takes_down_bwd = takes_weight_grad = takes_fp8_rows = staticmethod(_takes)

    def available(self, device: torch.device) -> bool:
        return True

    def preferred(self, device: torch.device) -> bool:
        return True

    def up(self, plan, x_LD, w1_EFD, activation, store_preact, store_act, *, b1_EF=None, interleaved=False,
           w1_up=None):
        return launchers.up(x_LD, whole_w1(w1_EFD, w1_up), plan.token_R, plan.offsets_E1, plan.sched, activation,
                            store_preact, store_act, b1_EF=b1_EF, interleaved=interleaved)

    def down(self, plan, act_RH, w2_EDH):
        return launchers.rows_gemm(act_RH, w2_EDH, (w2_EDH.stride(0), w2_EDH.stride(2), w2_EDH.stride(1)),
                                   w2_EDH.shape[1], plan.offsets_E1, plan.sched)

    def dx_rows(self, plan, dpreact_RF, w1_EFD, *, w1_up=None):
        w1_EFD = whole_w1(w1_EFD, w1_up)
        return launchers.rows_gemm(dpreact_RF, w1_EFD, (w1_EFD.stride(0), w1_EFD.stride(1), w1_EFD.stride(2)),
                                   w1_EFD.shape[2], plan.offsets_E1, plan.sched)

    def down_bwd(self, plan, dy_LD, w2_EDH, preact_RF, topk_w_LK, dpreact_RF, activation, *, interleaved=False,
                 preact_scale=None):
        if preact_scale is not None:  # e4m3 preact read back into dH's buffer, one pass, dH then computed over it
            preact_RF = quant.dequantize_rows(preact_RF, preact_scale, dpreact_RF.dtype, out=dpreact_RF)
        return launchers.down_bwd(dy_LD, w2_EDH, preact_RF, topk_w_LK, dpreact_RF, plan, activation,
                                  interleaved=interleaved)

    def weight_grad(self, plan, p, q, out, gather_p, *, out_up=None):
        if out_up is None:
            return launchers.weight_grad(p, q, out, plan.token_R, plan.offsets_E1, gather_p)
        whole = launchers.weight_grad(p, q, out.new_empty(out.shape[0], out.shape[1] + out_up.shape[1],
                                                          out.shape[2]), plan.token_R, plan.offsets_E1, gather_p)
        out.copy_(whole[:, :out.shape[1]])
        out_up.copy_(whole[:, out.shape[1]:])
        return out

    def fp8_rows(self, plan, a_q, w_q, out_dtype, token=None):
        return fp8_rows_gemm(*a_q, *w_q, plan.num_rows, plan.offsets_E1, plan.sched, token, out_dtype=out_dtype)


TL = TlBackend()
