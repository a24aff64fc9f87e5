"""The Hopper Gluon kernels as a kernel backend (experts.backends), each stage beside the check of the operands
it takes: bf16/fp16 (e4m3 for fp8_rows), contiguous, 16-byte aligned (TMA and cp.async) and the widths below. A
launch they don't take runs on tl. backend="auto" prefers them on sm_90 GPUs unless MOEBLAZE_GLUON=0.
Memory: each stage allocates its outputs only."""
from __future__ import annotations

import functools

import torch

from ... import env
from ..tl import launchers as tl
from . import GATHER_BLOCK_K, WGRAD_BLOCKS, fp8_rows_gemm, gathered_rows_gemm, rows_gemm, up_swiglu, weight_grad


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _takes(*tensors: torch.Tensor | None, dtypes=(torch.bfloat16, torch.float16)) -> bool:
    """Operands a Gluon kernel can read: bf16/fp16 (or dtypes), contiguous, 16-byte aligned; None (an optional
    part that is absent) passes."""
    return all(t is None or (t.dtype in dtypes and t.is_contiguous() and t.data_ptr() % 16 == 0) for t in tensors)


class GluonBackend:
    name = "gluon"
    needs = "an sm_90 (Hopper) GPU outside the Triton interpreter"

    def available(self, device: torch.device) -> bool:
        if device.type != "cuda" or env.INTERPRET:
            return False
        return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] == 9

    def preferred(self, device: torch.device) -> bool:
        return env.GLUON_BY_DEFAULT and self.available(device)

    def takes_up(self, plan, x_LD, w1_EFD, activation, store_preact, store_act, *, b1_EF=None, interleaved=False,
                 w1_up=None) -> bool:
        """SwiGLU without a bias, the gate rows first, D a multiple of a gathered stage's K; W1 whole or in two
        parts (w1_up: the up rows), each read in place."""
        return (activation == "swiglu" and b1_EF is None and not interleaved
                and x_LD.shape[1] % GATHER_BLOCK_K == 0 and _takes(x_LD, w1_EFD, w1_up))

    def up(self, plan, x_LD, w1_EFD, activation, store_preact, store_act, *, b1_EF=None, interleaved=False,
           w1_up=None):
        preact, act = up_swiglu(x_LD, w1_EFD, plan.token_R, plan.offsets_E1, plan.sched, w1_up=w1_up,
                                store_preact=store_preact, store_act=store_act)
        return (preact if store_preact else x_LD.new_empty(0)), (act if store_act else x_LD.new_empty(0))

    @staticmethod
    def _takes_rows(a, w, w_up=None) -> bool:
        """A row GEMM: K and N multiples of 8 (16-byte TMA rows); W1 in two parts (w_up) where the gate part's rows
        are a multiple of a stage's K (GATHER_BLOCK_K: no box straddles the two)."""
        return (a.shape[1] % 8 == 0 and w.shape[1] % 8 == 0 and w.shape[2] % 8 == 0
                and (w_up is None or w.shape[1] % GATHER_BLOCK_K == 0) and _takes(a, w, w_up))

    def takes_down(self, plan, act_RH, w2_EDH) -> bool:
        return self._takes_rows(act_RH, w2_EDH)

    def down(self, plan, act_RH, w2_EDH):
        return rows_gemm(act_RH, w2_EDH, plan.offsets_E1, plan.sched)

    def takes_dx_rows(self, plan, dpreact_RF, w1_EFD, *, w1_up=None) -> bool:
        return self._takes_rows(dpreact_RF, w1_EFD, w1_up)

    def dx_rows(self, plan, dpreact_RF, w1_EFD, *, w1_up=None):
        return rows_gemm(dpreact_RF, w1_EFD, plan.offsets_E1, plan.sched, kn=True, w_up=w1_up)

    def takes_down_bwd(self, plan, dy_LD, w2_EDH, preact_RF, topk_w_LK, dpreact_RF, activation, *,
                       interleaved=False, preact_scale=None) -> bool:
        """D a multiple of a gathered stage's K, H of 8."""
        return (dy_LD.shape[1] % GATHER_BLOCK_K == 0 and w2_EDH.shape[2] % 8 == 0 and preact_RF.is_contiguous()
                and _takes(dy_LD, w2_EDH))

    def down_bwd(self, plan, dy_LD, w2_EDH, preact_RF, topk_w_LK, dpreact_RF, activation, *, interleaved=False,
                 preact_scale=None):
        """dA' by the gathering GEMM into the s·A buffer, then the activation's backward as a pass of its own (tl's
        act_bwd), which overwrites dA' with s·A (a fused epilogue leaves the tensor cores idle at ~60% of the
        rate); e4m3 preact is read back inside that pass."""
        act_scaled = gathered_rows_gemm(dy_LD, w2_EDH, plan.token_R, plan.offsets_E1, plan.sched)
        return act_scaled, tl.act_bwd(act_scaled, preact_RF, plan.token_R, plan.token_slot_LK, topk_w_LK, dpreact_RF,
                                      act_scaled, activation, interleaved=interleaved, preact_scale=preact_scale)

    def takes_weight_grad(self, plan, p, q, out, gather_p, *, out_up=None) -> bool:
        """dW (out, contiguous) in the operands' dtype or float32, the gathered side's width a multiple of its block
        (WGRAD_BLOCKS), the dense side's and dW's columns multiples of 8; dW in two parts (out_up: dW1's up rows)
        where the first part's rows are a multiple of a tile's (every tile in one part)."""
        gathered, dense = (p, q) if gather_p else (q, p)
        return (p.dtype == q.dtype and (out_up is None or out_up.dtype == out.dtype)
                and gathered.shape[1] % WGRAD_BLOCKS[0 if gather_p else 1] == 0 and dense.shape[1] % 8 == 0
                and out.shape[2] % 8 == 0 and (out_up is None or out.shape[1] % WGRAD_BLOCKS[0] == 0)
                and _takes(p, q) and _takes(out, out_up, dtypes=(p.dtype, torch.float32)))

    def weight_grad(self, plan, p, q, out, gather_p, *, out_up=None):
        return weight_grad(p, q, plan.token_R, plan.offsets_E1, out, gather_p, out_up=out_up)

    def takes_fp8_rows(self, plan, a_q, w_q, out_dtype, token=None) -> bool:
        """A and W e4m3, K a multiple of 128 (A's rows read by the gathering loader, in place too: whole 16-byte
        copies of whole scale groups), N of 8, C in bf16/fp16/fp32."""
        w = w_q[0]
        return (w.shape[2] % 128 == 0 and w.shape[1] % 8 == 0
                and out_dtype in (torch.bfloat16, torch.float16, torch.float32)
                and _takes(a_q[0], w, dtypes=(torch.float8_e4m3fn,)))

    def fp8_rows(self, plan, a_q, w_q, out_dtype, token=None):
        return fp8_rows_gemm(*a_q, *w_q, plan.num_rows, plan.offsets_E1, plan.sched, token, out_dtype=out_dtype)


GLUON = GluonBackend()
