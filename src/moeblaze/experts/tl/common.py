"""tl helpers shared by the expert kernels: activations and their derivatives, the tile walk over the
schedule, row addressing and the row GEMM's main loop.

Activation codes (ACT): 0 SiLU, 1 GELU (erf), 2 ReLU, 3 squared ReLU, 4 gpt-oss's clamped SwiGLU (gated only).
GATED: act(gate) * up ((clamp(up) + 1) · act(gate) for code 4). Gate and up columns of the pre-activation (and
rows of W1): pair n at columns n and H + n, or, where INTERLEAVED, at 2n and 2n + 1 (_pair_cols).
"""
import triton
import triton.language as tl

from ...reference import CLAMP_ALPHA, CLAMP_LIMIT

ACT_CODES = {"swiglu": 0, "geglu": 1, "silu": 0, "gelu": 1, "relu": 2, "relu2": 3, "clamped_swiglu": 4}
LIMIT: tl.constexpr = tl.constexpr(CLAMP_LIMIT)
ALPHA: tl.constexpr = tl.constexpr(CLAMP_ALPHA)


@triton.jit
def _pair_cols(n, H, INTERLEAVED: tl.constexpr):
    """(gate column, offset of the up column from it) of gate/up pairs n."""
    if INTERLEAVED:
        return 2 * n, 1
    return n, H


@triton.jit
def _clamped_glu(g, u):
    """gpt-oss's clamped SwiGLU and its partial derivatives: (A, dA/dgate, dA/dup), fp32. The clamps pass no
    gradient beyond the limits (gate > limit, |up| > limit), as torch.clamp's backward."""
    gc = tl.minimum(g, LIMIT)
    uc = tl.minimum(tl.maximum(u, -LIMIT), LIMIT) + 1.0
    sg = tl.sigmoid(gc * ALPHA)
    act_g = gc * sg
    dg = tl.where(g <= LIMIT, uc * sg * (1.0 + gc * ALPHA * (1.0 - sg)), 0.0)
    du = tl.where((u >= -LIMIT) & (u <= LIMIT), act_g, 0.0)
    return act_g * uc, dg, du


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 0:
        return g * tl.sigmoid(g)
    elif ACT == 1:
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    elif ACT == 2:
        return tl.maximum(g, 0.0)
    else:
        r = tl.maximum(g, 0.0)
        return r * r


@triton.jit
def _act_grad(g, ACT: tl.constexpr):
    """d act(g) / d g, recomputed from the saved pre-activation."""
    if ACT == 0:
        s = tl.sigmoid(g)
        return s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        return 0.5 * (1.0 + tl.erf(g * 0.7071067811865476)) + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    elif ACT == 2:
        return (g > 0.0).to(g.dtype)
    else:
        return 2.0 * tl.maximum(g, 0.0)


@triton.jit
def _swizzle(pid, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid: GROUP_M row tiles sweep the columns together."""
    width = GROUP_M * n_tiles_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(n_tiles_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _tile_rows(tile, tile_expert_ptr, tile_row_ptr, expert_offsets_ptr, BLOCK_M: tl.constexpr):
    """(expert, row ids, row mask) of one schedule tile; expert < 0 marks an unused tile."""
    e = tl.load(tile_expert_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(expert_offsets_ptr + e + 1, mask=e >= 0, other=0)
    rows = row0 + tl.arange(0, BLOCK_M)
    return e, rows, rows < row_end


@triton.jit
def _row_ptrs(ptr, rows, stride, cols):
    """ptr + rows·stride + cols over a tile's consecutive rows: one 64-bit base at the first row, int32
    offsets from it. Per-element 64-bit addresses held the dH epilogue's spills at 448 B per thread
    against 328 (sm_90, ahead-of-time compile; no time difference measured at config E)."""
    row0 = tl.min(rows)
    return ptr + row0.to(tl.int64) * stride + ((rows - row0)[:, None] * stride + cols[None, :])


@triton.jit
def _rows_dot(a_ptr, a_rows, rmask, stride_al, stride_ad, b_ptr, stride_bk, stride_bn, offs_n, nmask, K_DIM,
              a_desc, b_desc, b_row0, A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 (BLOCK_M, BLOCK_N) = A[a_rows, :K_DIM] @ B[:K_DIM, offs_n] (B addressed by strides).

    A_TMA: a_rows are contiguous and A is read through the descriptor a_desc (block BLOCK_M x BLOCK_K).
    B_TMA: B is read through b_desc over the 2D view of all experts' weights, this expert's first row
    b_row0, as (n, k) rows if B_KMAJOR else (k, n). A descriptor reads whole blocks: rows of the next
    expert past K_DIM meet A's zero columns, and columns past N are never stored."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_al
    b_base = b_ptr + offs_n[None, :] * stride_bn
    row0 = tl.min(a_rows)  # the descriptor paths address blocks by their first row / column
    n0 = tl.min(offs_n)
    for k0 in range(0, K_DIM, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K_DIM
        if A_TMA:
            a = a_desc.load([row0, k0])
        else:
            a = tl.load(a_base + offs_k[None, :] * stride_ad, mask=rmask[:, None] & kmask[None, :], other=0.0)
        if B_TMA:
            if B_KMAJOR:
                b = tl.trans(b_desc.load([b_row0 + n0, k0]))
            else:
                b = b_desc.load([b_row0 + k0, n0])
        else:
            b = tl.load(b_base + offs_k[:, None] * stride_bk, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc
