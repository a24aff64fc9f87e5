"""The expert GEMMs on e4m3 operands with DeepSeek-V3's scales, portable tl kernels (precision="fp8" off Hopper):

  fp8_rows_gemm    C[rows] = A[rows] · B[e]ᵀ for each expert's rows of the tile schedule, A's rows read in place or
                   gathered through the token ids (x and dy are quantized once per token, so their scales follow
                   the gather), one fp32 scale per 1 x 128 group of A's rows and per 128 x 128 block of B

Main loops run over 128-deep blocks of the contraction: acc += dot(a, b) · scales, each block's dot from zero in
fp32, which promotes the accumulation every 128 (the block's partial sum never stays in the tensor cores' narrower
accumulator). fp8_rows_gemm's BLOCK_N is 128, so a tile's weight scale is one scalar per block. fp8 MMAs need
both operands K-major, as both get them.

Under Triton's CPU interpreter (no fp8 there) the operands may be float16 holding the e4m3 values exactly (every
e4m3 value is a float16): the same kernel logic, checked against reference.fp8's emulation.

Memory: nothing beyond the outputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...env import INTERPRET
from ...launch import cdiv, launch
from ..schedule import BLOCK_M
from .common import _swizzle, _tile_rows

GROUP = 128  # the scale groups: 1 x 128 for A, 128 x 128 for B


@triton.jit
def _fp8_rows_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, token_ptr, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr,
                     NUM_TILES, N, K_DIM, stride_al, stride_sal, stride_be, stride_bn, stride_sbe, stride_sbn,
                     stride_cl, GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tile, pid_n = _swizzle(tl.program_id(0), NUM_TILES, tl.cdiv(N, BLOCK_N), GROUP_M)
    e, rows, rmask = _tile_rows(tile, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, BLOCK_M)
    if e < 0:
        return
    src = tl.load(token_ptr + rows, mask=rmask, other=0) if GATHER else rows
    src = src.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + e.to(tl.int64) * stride_be
    sb_base = sb_ptr + e.to(tl.int64) * stride_sbe + (pid_n * BLOCK_N // BLOCK_K) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K_DIM, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        kmask = k < K_DIM
        a = tl.load(a_ptr + src[:, None] * stride_al + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_base + offs_n[None, :].to(tl.int64) * stride_bn + k[:, None],
                    mask=kmask[:, None] & nmask[None, :], other=0.0)
        sa = tl.load(sa_ptr + src * stride_sal + kb, mask=rmask, other=0.0)
        sb = tl.load(sb_base + kb)
        acc += tl.dot(a, b, out_dtype=tl.float32) * (sa[:, None] * sb)
    c = c_ptr + rows.to(tl.int64)[:, None] * stride_cl + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


def fp8_rows_gemm(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
                  num_rows: int, offsets: torch.Tensor, sched, token: torch.Tensor | None = None, *,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """C (num_rows, N) in out_dtype: row r of expert e is A[token[r] if token is given else r] · B[e]ᵀ, with
    a_q (·, K) e4m3 (or float16 holding e4m3 values) and its 1 x 128 scales a_scale (·, ceil(K / 128)) fp32, b_q
    (E, N, K) K-major with its 128 x 128 block scales b_scale (E, ceil(N / 128), ceil(K / 128)) fp32
    (reference.fp8.quantize_rows / quantize_blocks); offsets (E + 1,) and sched the routing's tile schedule."""
    E, N, K = b_q.shape
    if a_q.shape[1] != K or b_q.stride(2) != 1 or a_q.stride(1) != 1:
        raise ValueError(f"fp8_rows_gemm: A (·, {a_q.shape[1]}) and B (E, N, {K}) must share K, both K-contiguous")
    if INTERPRET:  # no fp8 in the interpreter: float16 holds every e4m3 value exactly
        a_q, b_q = (t.to(torch.float16) if t.dtype == torch.float8_e4m3fn else t for t in (a_q, b_q))
    c = torch.empty(num_rows, N, dtype=out_dtype, device=a_q.device)
    num_tiles = sched[0].shape[0]
    if num_rows == 0 or num_tiles == 0:
        return c
    block_n = GROUP
    launch(_fp8_rows_kernel, (num_tiles * cdiv(N, block_n),), a_q, a_scale, b_q, b_scale, c,
           token if token is not None else offsets, sched[0], sched[1], offsets, num_tiles, N, K, a_q.stride(0),
           a_scale.stride(0), b_q.stride(0), b_q.stride(1), b_scale.stride(0), b_scale.stride(1), c.stride(0),
           GATHER=token is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=GROUP, GROUP_M=8,
           num_warps=4 if INTERPRET else 8, num_stages=1 if INTERPRET else 3)
    return c


