"""What limits the fp8 Hopper GEMM (experts/gluon_sm90/fp8.py): the kernel timed beside variants that each take one
suspect away, on a config's four expert GEMM shapes (up and dA' gathered, down and dX~ in place), with the bf16
Gluon row GEMMs on the same shapes. Each shape's variants are timed in turns (moeblaze.bench.harness), and each fp8
variant's output is compared with the kernel's (equal_to_fp8: they do the same arithmetic).

  fp8             the kernel as the experts run it (A in place through the gathering loader, identity tokens)
  fp8-tma         A in place read by TMA (fp8_rows_gemm(tma_a=True)); in-place shapes only
  fp8-wait0       the promotion with no next stage in flight (wgmma.wait_group 0 before each stage's scaling)
  fp8-256         128 x 256 tiles as two 128 x 128 halves sharing each stage's A (half the gathered A per FLOP, a
                  quarter less into shared memory), each half promoted as fp8-wait0 does; 3 stages. Its two
                  accumulators and a stage in flight are past the registers: it spills (~200 B a thread on
                  triton 3.6, 8 B on 3.9, sm_90), which its time includes
(One accumulator chained through the stages with no promotion at all, the bound that would show the promotion's
whole cost, fails to compile on triton 3.6: an assertion in its lowering of a chained fp8 wgmma; so does a stage's
result added unscaled or scaled by the block's scale alone.)
  bf16            gluon_sm90.gathered_rows_gemm / rows_gemm on the same shape, bf16 operands

    python scripts/fp8_kernel_lab.py [--out DIR] [--configs D]      (Hopper; rows in DIR/fp8_kernel_lab.jsonl)
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from moeblaze.bench.harness import CONFIGS, _timed_rounds
from moeblaze.experts import gluon_sm90
from moeblaze.experts.gluon_sm90.common import (GATHER_WARPS, descriptor, mma_layout, my_tiles, stage_barriers,
                                                store_tile)
from moeblaze.experts.gluon_sm90.fp8 import FP8_BLOCK_N, FP8_STAGES, _scales, scaled_tile
from moeblaze.experts.gluon_sm90.partitions import gather_loader
from moeblaze.experts.schedule import BLOCK_M
from moeblaze.experts.stages import RowPlan
from moeblaze.experts.tl import quant
from moeblaze.routing import build_routing_index, route_topk


@gluon.jit
def _mma_wait0(c_smem, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, sa_ptr, stride_sal, sb_ptr,
                 stride_sbe, stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                 used_tiles_ptr, N, K_DIM):
    """Each stage from zero, waited for (wait_group 0: nothing of the next stage in flight), then scaled into the
    accumulator."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    acc_layout: gl.constexpr = mma_layout(8, BLOCK_N, 32)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    n_tn = gl.cdiv(N, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    pid, nprog, n_used, n_mine = my_tiles(used_tiles_ptr, n_tn)
    offs_m = gl.arange(0, BLOCK_M, layout=row_layout)
    for j in range(n_mine):
        row0, row_end, pid_n, rmask, sa_ptrs, sb_tile = scaled_tile(
            j, pid, nprog, n_used, n_tn, offs_m, token_ptr, n_rows, sa_ptr, stride_sal, sb_ptr, stride_sbe,
            stride_sbn, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, BLOCK_N)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for k in range(n_k):
            c = j * n_k + k
            s = c % S
            mbarrier.wait(ready.index(s), (c // S) & 1)
            fence_async_shared()
            part = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)),
                                 gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout), use_acc=False,
                                 max_num_imprecise_acc=BLOCK_K, is_async=True)
            scale = _scales(sa_ptrs, sb_tile, rmask, k)
            done = warpgroup_mma_wait(0, deps=(part, ))
            mbarrier.arrive(empty.index(s))
            acc += done * scale[:, None]
        store_tile(acc, c_smem, c_desc, c_ptr, stride_cl, row0, row_end, pid_n * BLOCK_N, N)
    tma.store_wait(0)


@gluon.jit
def _mma_dual(c_smem, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, sa_ptr, stride_sal, sb_ptr,
              stride_sbe, stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
              used_tiles_ptr, N, K_DIM):
    """A 128 x 256 tile as two 128 x 128 halves sharing each stage's A: per stage, the first half's MMAs from zero,
    waited for and scaled into its accumulator, then the second's; registers: two accumulators and one stage."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    HALF: gl.constexpr = BLOCK_N // 2
    acc_layout: gl.constexpr = mma_layout(8, HALF, 32)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    n_tn = gl.cdiv(N, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    pid, nprog, n_used, n_mine = my_tiles(used_tiles_ptr, n_tn)
    offs_m = gl.arange(0, BLOCK_M, layout=row_layout)
    for j in range(n_mine):
        row0, row_end, pid_n, rmask, sa_ptrs, sb0 = scaled_tile(
            j, pid, nprog, n_used, n_tn, offs_m, token_ptr, n_rows, sa_ptr, stride_sal, sb_ptr, stride_sbe,
            stride_sbn, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, BLOCK_N)
        has1 = pid_n * BLOCK_N + HALF < N
        acc0 = gl.zeros([BLOCK_M, HALF], gl.float32, acc_layout)
        acc1 = gl.zeros([BLOCK_M, HALF], gl.float32, acc_layout)
        for k in range(n_k):
            c = j * n_k + k
            s = c % S
            mbarrier.wait(ready.index(s), (c // S) & 1)
            fence_async_shared()
            a = a_bufs.index(s)
            b = b_bufs.index(s)
            part = warpgroup_mma(a, b.slice(0, HALF, dim=0).permute((1, 0)),
                                 gl.zeros([BLOCK_M, HALF], gl.float32, acc_layout), use_acc=False,
                                 max_num_imprecise_acc=BLOCK_K, is_async=True)
            sa = gl.load(sa_ptrs + k, mask=rmask, other=0.0)
            s0 = gl.load(sb0 + k)
            s1 = gl.load(sb0 + stride_sbn + k, mask=has1, other=0.0)
            done = warpgroup_mma_wait(0, deps=(part, ))
            acc0 += done * (sa * s0)[:, None]
            part = warpgroup_mma(a, b.slice(HALF, HALF, dim=0).permute((1, 0)),
                                 gl.zeros([BLOCK_M, HALF], gl.float32, acc_layout), use_acc=False,
                                 max_num_imprecise_acc=BLOCK_K, is_async=True)
            done = warpgroup_mma_wait(0, deps=(part, ))
            mbarrier.arrive(empty.index(s))
            acc1 += done * (sa * s1)[:, None]
        store_tile(acc0, c_smem, c_desc, c_ptr, stride_cl, row0, row_end, pid_n * BLOCK_N, N)
        store_tile(acc1, c_smem, c_desc, c_ptr, stride_cl, row0, row_end, pid_n * BLOCK_N + HALF, N)
    tma.store_wait(0)


@gluon.jit
def fp8_wait0_kernel(x_ptr, stride_xl, token_ptr, n_rows, b_desc, c_desc, c_ptr, stride_cl, sa_ptr, stride_sal,
                       sb_ptr, stride_sbe, stride_sbn, tile_expert_ptr, tile_row_ptr, used_tiles_ptr,
                       expert_offsets_ptr, N, K_DIM, DUAL: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                       WORKER_REGS: gl.constexpr):
    """The gathering loader behind _mma_wait0, or (DUAL, BLOCK_N 256) _mma_dual."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], b_desc.dtype)
    a_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready, empty = stage_barriers(STAGES, 32 * GATHER_WARPS + 1)
    mma_args = (c_smem, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, sa_ptr, stride_sal, sb_ptr, stride_sbe,
                stride_sbn, token_ptr, n_rows, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, used_tiles_ptr, N,
                K_DIM)
    loader_args = (x_ptr, stride_xl, token_ptr, n_rows, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr,
                   tile_row_ptr, used_tiles_ptr, N, K_DIM)
    if DUAL:
        gl.warp_specialize([(_mma_dual, mma_args), (gather_loader, loader_args)], [GATHER_WARPS], [WORKER_REGS])
    else:
        gl.warp_specialize([(_mma_wait0, mma_args), (gather_loader, loader_args)], [GATHER_WARPS], [WORKER_REGS])


def fp8_lab(a_q, a_scale, b_q, b_scale, num_rows, offsets, sched, token, dual: bool = False):
    """gluon_sm90.fp8_rows_gemm's launch with the wait-0 MMA partition (dual: 128 x 256 tiles in two halves,
    3 stages), bf16 out."""
    from moeblaze.launch import launch, sm_count

    E, N, K = b_q.shape
    c = a_q.new_empty(num_rows, N, dtype=torch.bfloat16)
    if token is None:
        token = torch.arange(num_rows, dtype=torch.int32, device=a_q.device)
    block_n = 2 * FP8_BLOCK_N if dual else FP8_BLOCK_N
    launch(fp8_wait0_kernel, (sm_count(a_q.device),), a_q, a_q.stride(0), token, token.shape[0],
           descriptor(b_q.reshape(E * N, K), [block_n, 128]), descriptor(c, [BLOCK_M, FP8_BLOCK_N]), c,
           c.stride(0), a_scale, a_scale.stride(0), b_scale, b_scale.stride(0), b_scale.stride(1), sched[0],
           sched[1], sched[2], offsets, N, K, DUAL=dual, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=128,
           STAGES=3 if dual else FP8_STAGES, WORKER_REGS=56, num_warps=8, maxnreg=168)
    return c


def variants(a, w, plan, R, gathered) -> dict:
    """{impl: step(i)} on one shape (see the module header)."""
    aq, wq = quant.quantize_rows(a), quant.quantize_blocks(w)
    tok = plan.token_R if gathered else None
    args = (*aq, *wq, R, plan.offsets_E1, plan.sched)
    fns = {"fp8": lambda i: gluon_sm90.fp8_rows_gemm(*args, tok, torch.bfloat16),
           "fp8-wait0": lambda i: fp8_lab(*args, tok),
           "fp8-256": lambda i: fp8_lab(*args, tok, dual=True)}
    if not gathered:
        fns["fp8-tma"] = lambda i: gluon_sm90.fp8_rows_gemm(*args, None, torch.bfloat16, tma_a=True)
        fns["bf16"] = lambda i: gluon_sm90.rows_gemm(a, w, plan.offsets_E1, plan.sched)
    else:
        w_kn = w.transpose(1, 2).contiguous()  # the gathering bf16 GEMM takes W (E, K, N)
        fns["bf16"] = lambda i: gluon_sm90.gathered_rows_gemm(a, w_kn, plan.token_R, plan.offsets_E1, plan.sched)
    return fns


def measure(config, meta) -> list:
    L, d, h, E, K = CONFIGS[config]
    torch.manual_seed(0)
    idx, _ = route_topk(torch.randn(L, E, device="cuda"), K)
    plan = RowPlan.build(build_routing_index(idx, E))
    R = L * K
    rows = []
    # (gemm, A's rows, N, K, gathered): C (R, N) = A[token or rows] · W[e]ᵀ, W (E, N, K)
    for gemm, m_src, n, kd, gathered in (("up", L, 2 * h, d, True), ("down", R, d, h, False),
                                         ("dA'", L, h, d, True), ("dX~", R, d, 2 * h, False)):
        a = torch.randn(m_src, kd, device="cuda").bfloat16()
        w = (torch.randn(E, n, kd, device="cuda") * kd ** -0.5).bfloat16()
        fns = variants(a, w, plan, R, gathered)
        want = fns["fp8"](0)
        same = {}  # each fp8 variant's output against the kernel's: the same arithmetic, so equal
        for impl, fn in fns.items():
            if impl.startswith("fp8-"):
                try:
                    same[impl] = bool(torch.equal(fn(0), want))
                except Exception as ex:  # noqa: BLE001  (a variant that fails is reported, the others run)
                    print(f"{config} {gemm} {impl}: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                    fns.pop(impl)
        times = _timed_rounds(fns, torch.device("cuda"), iters=10)
        for impl, res in times.items():
            if isinstance(res, Exception):
                print(f"{config} {gemm} {impl}: {res}", flush=True)
                continue
            row = dict(mode="fp8-kernel-lab", config=config, gemm=gemm, R=R, N=n, K=kd, gathered=gathered, impl=impl,
                       ms=round(res[0], 4), tflops=round(2 * R * n * kd / (res[0] * 1e-3) / 1e12, 1),
                       equal_to_fp8=same.get(impl), **meta)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del a, w
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--configs", default="D")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                git_sha=os.environ.get("MOEBLAZE_GIT_SHA", "unknown"), command="python scripts/fp8_kernel_lab.py")
    rows = [r for c in args.configs.split(",") for r in measure(c, meta)]
    with open(os.path.join(args.out, "fp8_kernel_lab.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
