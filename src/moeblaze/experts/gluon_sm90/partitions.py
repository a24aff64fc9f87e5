"""The partitions the Gluon kernels are built from (gl.warp_specialize), each a loop over this program's tiles:

  tma_loader       fills the stages through TMA (A's rows and W's box); tma_loader_parts with W in two parts
  gather_loader    W through TMA, the routed rows x[token[r]] through cp.async (a whole warpgroup of them)
  mma_handoff      8 MMA warps that hand each finished accumulator to a store partition through shared memory
                   and go on with the next tile
  mma_store        8 MMA warps that store their own tiles (mma_steps, then store_tile): where the loader
                   gathers, the warps a store partition would take go to the loader instead (1-3% faster at
                   B, D and E)
  store_partition  2 warps that store the handed-off tiles: one TMA store for a tile within its expert,
                   masked pieces for the expert's last tile

Rows past an expert's end are loaded (they belong to the next expert) but never stored. Memory: shared
memory only (the stages and the hand-off tile).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait

from .common import (cp_async, gather_layout, mma_layout, mma_steps, my_tiles, store_pieces, store_tile, tile_of,
                     tile_start, tma_load, tma_store)

EPI_WARPS = gl.constexpr(2)  # warps of a store partition (the up-projection's SwiGLU epilogue too)


@gluon.jit
def tma_loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, N, K_DIM):
    """Fills the stages through TMA: A's rows of the tile (past the expert's end, the next expert's rows:
    never stored); B as (BLOCK_N, BLOCK_K) boxes of W's (E·N, K) view, or (B_KN, stages of (BLOCK_K,
    BLOCK_N)) boxes of its (E·K, N) view. The next tile's schedule entry is loaded while this tile's stages
    are issued."""
    _tma_loads(a_desc, b_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, used_tiles_ptr, N,
               K_DIM, K_DIM, False)


@gluon.jit
def tma_loader_parts(a_desc, b_desc, b_up_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr,
                     used_tiles_ptr, N, K_DIM, SPLIT_K):
    """tma_loader with W[e] (K, N) in two parts (B_KN): its first SPLIT_K rows b_desc's (E·SPLIT_K, N), the rest
    b_up_desc's, each read in place (W1 as gate and up rows, for dX~); SPLIT_K a multiple of BLOCK_K, so that no
    box straddles the two. A partition of its own, not a flag: warp_specialize hands its partitions their
    arguments as runtime values, constexpr or not."""
    _tma_loads(a_desc, b_desc, b_up_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, used_tiles_ptr,
               N, K_DIM, SPLIT_K, True)


@gluon.jit
def _tma_loads(a_desc, b_desc, b_up_desc, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr, used_tiles_ptr,
               N, K_DIM, SPLIT_K, W_PARTS: gl.constexpr):
    """The loop of tma_loader and tma_loader_parts."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    B_KN: gl.constexpr = b_bufs.type.shape[2] != BLOCK_K
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if B_KN else b_bufs.type.shape[1]
    n_tn = gl.cdiv(N, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    pid, nprog, n_used, n_mine = my_tiles(used_tiles_ptr, n_tn)
    if n_mine > 0:
        e, row0, pid_n = tile_start(0, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr)
        for j in range(n_mine):
            # the last tile's entry again past the end: read, never used
            e1, row1, pid_n1 = tile_start(gl.minimum(j + 1, n_mine - 1), pid, nprog, n_used, n_tn,
                                           tile_expert_ptr, tile_row_ptr)
            for k in range(n_k):
                c = j * n_k + k
                s = c % S
                mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)  # a fresh barrier passes phase 1
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma_load(a_desc, [row0, k * BLOCK_K], ready.index(s), a_bufs.index(s))
                if W_PARTS:
                    kk = k * BLOCK_K
                    if kk < SPLIT_K:
                        tma_load(b_desc, [e * SPLIT_K + kk, pid_n * BLOCK_N], ready.index(s), b_bufs.index(s))
                    else:
                        tma_load(b_up_desc, [e * (K_DIM - SPLIT_K) + kk - SPLIT_K, pid_n * BLOCK_N], ready.index(s),
                                 b_bufs.index(s))
                elif B_KN:
                    tma_load(b_desc, [e * K_DIM + k * BLOCK_K, pid_n * BLOCK_N], ready.index(s), b_bufs.index(s))
                else:
                    tma_load(b_desc, [e * N + pid_n * BLOCK_N, k * BLOCK_K], ready.index(s), b_bufs.index(s))
            e, row0, pid_n = e1, row1, pid_n1


@gluon.jit
def gather_loader(x_ptr, stride_xl, token_ptr, n_rows, b_desc, b_up_desc, a_bufs, b_bufs, ready, empty,
                   tile_expert_ptr, tile_row_ptr, used_tiles_ptr, N, K_DIM, W_PARTS: gl.constexpr):
    """As tma_loader, with A's rows gathered: row r of the tile is x[token[r]], copied by cp.async; each of
    the partition's threads arrives on the stage's barrier when its copies land (the barrier counts them).
    Rows past the expert's end are copied too (the next expert's tokens; never stored), so a tile needs
    only its first row, and the loads that find a tile run ahead: tile j+2's schedule entry and tile j+1's
    token ids are loaded while tile j's stages are issued, off the path from one tile's last stage to the
    next tile's first.
    GATED: W is (E·2N, K) with each expert's N gate rows before its N up rows; a stage's B holds
    BLOCK_N/2 gate rows then the matching BLOCK_N/2 up rows, so one MMA computes both halves. With W_PARTS the
    gate rows (E·N, K) are b_desc's and the up rows (E·N, K) b_up_desc's, read in place (else b_up_desc is
    b_desc); a runtime flag in effect, as warp_specialize hands a partition every argument, but a select of two
    row offsets between the same two loads.
    B_KN: W is (E·K, N) (W2 for dA' = dy[token] @ W2[e]), its stages (BLOCK_K, BLOCK_N) boxes."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    B_KN: gl.constexpr = b_bufs.type.shape[2] != BLOCK_K
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if B_KN else b_bufs.type.shape[1]
    TILE_N: gl.constexpr = b_desc.block_type.shape[1] if B_KN else b_desc.block_type.shape[0]
    GATED: gl.constexpr = TILE_N != BLOCK_N  # W's box is half the stage: gate, then up
    layout: gl.constexpr = gather_layout(BLOCK_K, gl.num_warps(), a_bufs.dtype.primitive_bitwidth)
    n_tn = gl.cdiv(N, TILE_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    pid, nprog, n_used, n_mine = my_tiles(used_tiles_ptr, n_tn)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    if n_mine > 0:
        # the pipeline's first two tiles; past the last tile the entries repeat it, read but never used
        e, row0, pid_n = tile_start(0, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr)
        e1, row1, pid_n1 = tile_start(gl.minimum(1, n_mine - 1), pid, nprog, n_used, n_tn, tile_expert_ptr,
                                       tile_row_ptr)
        tok = gl.load(token_ptr + row0 + offs_m, mask=row0 + offs_m < n_rows, other=0)
        for j in range(n_mine):
            tok1 = gl.load(token_ptr + row1 + offs_m, mask=row1 + offs_m < n_rows, other=0)
            e2, row2, pid_n2 = tile_start(gl.minimum(j + 2, n_mine - 1), pid, nprog, n_used, n_tn,
                                           tile_expert_ptr, tile_row_ptr)
            rows_ptr = x_ptr + tok.to(gl.int64)[:, None] * stride_xl + offs_k[None, :]
            for k in range(n_k):
                c = j * n_k + k
                s = c % S
                mbarrier.wait(empty.index(s), ((c // S) & 1) ^ 1)  # a fresh barrier passes phase 1
                # W first: its TMA runs while the row copies are issued
                if GATED:
                    mbarrier.expect(ready.index(s), 2 * b_desc.block_type.nbytes)
                    stage = b_bufs.index(s)
                    if W_PARTS:
                        gate_row = e * N + pid_n * TILE_N
                        up_row = gate_row
                    else:
                        gate_row = e * 2 * N + pid_n * TILE_N
                        up_row = gate_row + N
                    tma_load(b_desc, [gate_row, k * BLOCK_K], ready.index(s), stage.slice(0, TILE_N))
                    tma_load(b_up_desc, [up_row, k * BLOCK_K], ready.index(s), stage.slice(TILE_N, TILE_N))
                elif B_KN:
                    mbarrier.expect(ready.index(s), b_desc.block_type.nbytes)
                    tma_load(b_desc, [e * K_DIM + k * BLOCK_K, pid_n * BLOCK_N], ready.index(s), b_bufs.index(s))
                else:
                    mbarrier.expect(ready.index(s), b_desc.block_type.nbytes)
                    tma_load(b_desc, [e * N + pid_n * BLOCK_N, k * BLOCK_K], ready.index(s), b_bufs.index(s))
                # K_DIM is a multiple of BLOCK_K (checked on the host): every copy is a whole 16 bytes
                cp_async(a_bufs.index(s), rows_ptr + k * BLOCK_K)
                async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            e, row0, pid_n, tok = e1, row1, pid_n1, tok1
            e1, row1, pid_n1 = e2, row2, pid_n2


@gluon.jit
def mma_handoff(c_smem, acc_ready, acc_empty, a_bufs, b_bufs, ready, empty, used_tiles_ptr, n_tn, K_DIM, fence):
    """Every tile of this program: MMAs over the loader's stages (both warpgroups, 64 rows each), then the
    accumulator into c_smem (io dtype) for the epilogue partition, which drains it during the next tile."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    B_KN: gl.constexpr = b_bufs.type.shape[2] != BLOCK_K  # stages of (BLOCK_K, BLOCK_N): no permute
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if B_KN else b_bufs.type.shape[1]
    acc_layout: gl.constexpr = mma_layout(8, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    pid, nprog, n_used, n_mine = my_tiles(used_tiles_ptr, n_tn)
    for j in range(n_mine):
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc = mma_steps(acc, j * n_k, n_k, a_bufs, b_bufs, ready, empty, fence)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((j * n_k + n_k - 1) % S))
        mbarrier.wait(acc_empty.index(0), (j & 1) ^ 1)  # the epilogue has read tile j-1
        c_smem.store(acc.to(c_smem.dtype))
        fence_async_shared()  # the epilogue may hand c_smem to a TMA store (async proxy)
        mbarrier.arrive(acc_ready.index(0))


@gluon.jit
def mma_store(c_smem, c_desc, c_ptr, stride_cl, a_bufs, b_bufs, ready, empty, tile_expert_ptr, tile_row_ptr,
               expert_offsets_ptr, used_tiles_ptr, N, K_DIM):
    """mma_handoff that stores each tile itself (store_tile) instead of handing it to a store partition:
    the tile is written to c_smem anyway, and a TMA store is one thread's work, so the warps a store
    partition would take go to the gathering loader instead."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    acc_layout: gl.constexpr = mma_layout(8, BLOCK_N)
    n_tn = gl.cdiv(N, BLOCK_N)
    n_k = gl.cdiv(K_DIM, BLOCK_K)
    pid, nprog, n_used, n_mine = my_tiles(used_tiles_ptr, n_tn)
    for j in range(n_mine):
        e, row0, row_end, pid_n = tile_of(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr,
                                           expert_offsets_ptr)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc = mma_steps(acc, j * n_k, n_k, a_bufs, b_bufs, ready, empty, True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((j * n_k + n_k - 1) % S))
        store_tile(acc, c_smem, c_desc, c_ptr, stride_cl, row0, row_end, pid_n * BLOCK_N, N)
    tma.store_wait(0)


@gluon.jit
def store_partition(c_smem, acc_ready, acc_empty, c_desc, c_ptr, stride_cl, tile_expert_ptr, tile_row_ptr,
                    expert_offsets_ptr, used_tiles_ptr, N):
    """Each tile from c_smem to C's rows: a tile of the expert's rows alone by one TMA store; the expert's
    last tile, whose rows run past its end, in pieces with masked stores."""
    BLOCK_M: gl.constexpr = c_smem.type.shape[0]
    BLOCK_N: gl.constexpr = c_smem.type.shape[1]
    n_tn = gl.cdiv(N, BLOCK_N)
    pid, nprog, n_used, n_mine = my_tiles(used_tiles_ptr, n_tn)
    for j in range(n_mine):
        e, row0, row_end, pid_n = tile_of(j, pid, nprog, n_used, n_tn, tile_expert_ptr, tile_row_ptr,
                                           expert_offsets_ptr)
        mbarrier.wait(acc_ready.index(0), j & 1)
        if row0 + BLOCK_M <= row_end:
            tma_store(c_desc, [row0, pid_n * BLOCK_N], c_smem)
            tma.store_wait(0)  # c_smem read: the MMA warps may overwrite it
        else:
            store_pieces(c_smem, c_ptr, stride_cl, row0, row_end, pid_n * BLOCK_N, N)
        mbarrier.arrive(acc_empty.index(0))
