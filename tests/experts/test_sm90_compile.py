"""Kernels compiled ahead of time for sm_90 without a GPU (Triton's ASTSource / GluonASTSource and its bundled
ptxas), where the interpreter would not tell: the Hopper bf16 weight gradient and the fp8 kernels (every variant the
launcher can pick compiles, issues its wgmma and spills nothing, or next to it; what they compute is checked on a GPU
only, tests/gpu/, since the interpreter does not run Gluon), and the tl kernels of the fp8 quantizers, the rounded
index, token rounding and the wide combine (the interpreter runs them; this checks that they also lower for the GPU)."""
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget

pytestmark = pytest.mark.usefixtures("triton_core_restored")  # compiled in this process: see the fixture
gluon_runtime = pytest.importorskip("triton.experimental.gluon._runtime")
if not hasattr(gluon_runtime, "GluonASTSource"):
    pytest.skip("this triton has no ahead-of-time Gluon source", allow_module_level=True)

from moeblaze.experts.gluon_sm90 import fp8  # noqa: E402
from moeblaze.experts.gluon_sm90.common import descriptor  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SIZES = ("n_rows", "N", "K_DIM")  # values, not 16-divisible in general; strides and pointers are (as launched)


def _mangle(desc) -> str:
    """A descriptor's signature type: its own __mangle__ (triton 3.9), the runtime's mangle_type before (3.6)."""
    if hasattr(desc, "__mangle__"):
        return desc.__mangle__()
    from triton.runtime.jit import mangle_type
    return mangle_type(desc)


def _compile(out_dtype: torch.dtype, tma_a: bool = False, worker_regs: int = 56, store_bufs: int | None = None,
             split: bool | None = None, mma_regs: int = fp8.FP8_MMA_REGS):
    """The fp8 row kernel as fp8_rows_gemm launches it (store_bufs and split: its defaults where None)."""
    fn = fp8.fp8_rows_tma_kernel if tma_a else fp8.fp8_rows_kernel
    if split is None:
        split = out_dtype == torch.bfloat16
    n_wg = 2 if split else 1
    w = torch.empty(8 * 256, 512, dtype=torch.float8_e4m3fn)
    c = torch.empty(1024, 256, dtype=out_dtype)
    descs = dict(b_desc=descriptor(w, [fp8.FP8_BLOCK_N, 128]), c_desc=descriptor(c, [128 // n_wg, 128]),
                 a_desc=descriptor(torch.empty(1024, 512, dtype=torch.float8_e4m3fn), [128, 128]))
    if store_bufs is None:  # the launcher's default
        store_bufs = 2 if out_dtype == torch.bfloat16 else 1
    consts = dict(BLOCK_M=128, BLOCK_N=fp8.FP8_BLOCK_N, BLOCK_K=128, STAGES=fp8.FP8_STAGES,
                  WORKER_REGS=worker_regs, STORE_BUFS=store_bufs, N_WG=n_wg, MMA_REGS=mma_regs)
    ptrs = dict(c_ptr="*bf16" if out_dtype == torch.bfloat16 else "*fp32", x_ptr="*fp8e4nv", sa_ptr="*fp32",
                sb_ptr="*fp32")
    return _compile_gluon(fn, descs, consts, ptrs, num_warps=8 // n_wg)


def _compile_gluon(fn, descs, consts, ptrs, sizes=SIZES, num_warps=8):
    """fn for sm_90: descriptors, constexprs and pointer types by parameter name; other pointers *i32, other
    scalars i32 (16-divisible unless named in sizes)."""
    sig, attrs = {}, {}
    for i, p in enumerate(fn.params):
        n = p.name
        if n in consts:
            sig[n] = "constexpr"
        elif n in descs:
            sig[n] = _mangle(descs[n])
        else:
            sig[n] = ptrs.get(n, "*i32" if n.endswith("_ptr") else "i32")
            if n not in sizes:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = gluon_runtime.GluonASTSource(fn, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, maxnreg=168))


@pytest.mark.parametrize("tma_a", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_rows_kernel_compiles_for_sm90(out_dtype, tma_a):
    """Both loaders (gathering; TMA for A in place, tma_a) and both output dtypes as the launcher runs them (bf16:
    two MMA warpgroups each on its own rows, each with two staging buffers for C; fp32: one 8-warp partition, one
    buffer): e4m3 wgmma on 128-column halves, within shared memory; no spills on triton 3.6, at most 8 bytes of
    stack a thread on 3.9 (fp8.py's header)."""
    ck = _compile(out_dtype, tma_a, fp8.FP8_WORKER_REGS)
    ptx = ck.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    assert ck.metadata.shared <= 227 * 1024
    assert _stack_bytes(ck) <= (0 if triton.__version__.startswith("3.6.") else 8)


def _stack_bytes(ck) -> int:
    """The most stack (spilled registers) a thread of the compiled kernel uses, from ptxas's cubin."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                               check=True).stdout
    stack = [int(s) for s in re.findall(r"STACK:(\d+)", usage)]
    assert stack, usage
    return max(stack)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("gather_p,c_parts", [(False, False), (True, False), (False, True)],
                         ids=["dW1", "dW2", "dW1-in-parts"])
def test_bf16_weight_grad_kernel_compiles_for_sm90(gather_p, c_parts, out_dtype):
    """The bf16 weight gradient (a bf16 layer's dW1 gathers Q = x, dW2 gathers P = dy; dW1 stored into W1's two
    parts, c_parts): bf16 wgmma on its 128 x 256 tiles, within shared memory, and no spills (its next tiles' row
    ranges are carried in registers). dW in bf16 goes out through a 64 KB staging tile and TMA stores; in float32
    (master weights) from the registers, with no staging tile."""
    from moeblaze.experts.gluon_sm90 import wgrad

    block_m, block_n = wgrad.WGRAD_BLOCKS
    dense = torch.empty(4096, 1024, dtype=torch.bfloat16)
    c = torch.empty(8 * 1024, 2048, dtype=out_dtype)
    descs = dict(dense_desc=descriptor(dense, [64, block_n if gather_p else block_m]),
                 c_desc=descriptor(c, [block_m, block_n]), c_up_desc=descriptor(c, [block_m, block_n]))
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, STAGES=3, WORKER_REGS=56, C_PARTS=c_parts)
    c_type = "*bf16" if out_dtype == torch.bfloat16 else "*fp32"
    # N (dW's columns) as Triton specializes it at the shapes that matter (16-divisible): a float32 dW's pairs are
    # stored 8 bytes at a time then
    sizes = ("E", "M", "SPLIT_M", "GROUP") + (("N",) if out_dtype == torch.bfloat16 else ())
    ck = _compile_gluon(wgrad.weight_grad_kernel, descs, consts, dict(src_ptr="*bf16", c_ptr=c_type,
                                                                      c_up_ptr=c_type), sizes=sizes)
    ptx = ck.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
    stages = 3 * 64 * (block_m + block_n) * 2
    tma_store = "cp.async.bulk.tensor.2d.global.shared"
    if out_dtype == torch.bfloat16:
        assert tma_store in ptx and ck.metadata.shared >= stages + block_m * block_n * 2
    else:  # no staging tile, and no TMA store
        assert "st.global.v2.b32" in ptx and tma_store not in ptx
        assert ck.metadata.shared < stages + block_m * block_n * 2
    assert ck.metadata.shared <= 227 * 1024
    assert _stack_bytes(ck) == 0


@pytest.mark.parametrize("w_parts", [False, True], ids=["whole", "w1-in-parts"])
@pytest.mark.parametrize("kn", [False, True], ids=["down", "dx"])
def test_bf16_rows_kernel_compiles_for_sm90(kn, w_parts):
    """The bf16 row GEMM (the down-projection, W stored (N, K); dX~, W1 stored (K, N), whole or as its two parts):
    bf16 wgmma on 128 x 256 tiles, within shared memory, no spills on triton 3.9 (3.6 spills 296 bytes a thread
    here, with W1 whole as before W1's parts were read)."""
    from moeblaze.experts.gluon_sm90 import rows

    if w_parts and not kn:
        pytest.skip("W1's parts are read by dX~ only")
    a = torch.empty(4096, 1024, dtype=torch.bfloat16)
    w = torch.empty(8 * 1024, 2048, dtype=torch.bfloat16)
    box = [64, 256] if kn else [256, 64]
    descs = dict(a_desc=descriptor(a, [128, 64]), b_desc=descriptor(w, box), b_up_desc=descriptor(w, box),
                 c_desc=descriptor(torch.empty(4096, 2048, dtype=torch.bfloat16), [128, 256]))
    consts = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, STAGES=3, WORKER_REGS=112, B_KN=kn, W_PARTS=w_parts)
    ck = _compile_gluon(rows.rows_gemm_kernel, descs, consts, dict(c_ptr="*bf16"), sizes=("N", "K_DIM", "SPLIT_K"))
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ck.asm["ptx"]
    assert ck.metadata.shared <= 227 * 1024
    assert _stack_bytes(ck) <= (296 if triton.__version__.startswith("3.6.") else 0)


# the tl kernels are compiled in a child process: this session runs them under the interpreter, which turns
# @triton.jit into its own function objects
TL_SNIPPET = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moeblaze.experts import quant
from moeblaze.experts.tl import backward, forward
from moeblaze.experts.tl import fp8 as tl_fp8
from moeblaze.routing import triton as rk

Q = dict(GROUP=128, AMAX_FLOOR=1e-12, INV_FP8_MAX=1 / 448, FP8_MAX=448.0, EMULATE=False)
ROWS = dict(t_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", qh_ptr="*fp8e4nv", sh_ptr="*fp32")
BLOCKS = dict(w_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32")
DH_PTRS = dict(dact_ptr="*bf16", preact_ptr="*fp8e4nv", preact_scale_ptr="*fp32", topk_w_ptr="*fp32",
               dpreact_ptr="*bf16", act_scaled_ptr="*bf16", dtopk_w_ptr="*fp32", dq_ptr="*fp8e4nv", dqs_ptr="*fp32")
DH = dict(K=8, GATED=True, ACT=0, INTERLEAVED=False, FP8_H=True, H_ALIGNED=False, QUANT_DH=False, WIDE=False,
          K_POW2=8, BLOCK_R=8, BLOCK_H=256)
KERNELS = [  # (kernel, pointer types, constexprs, warps)
    (quant._rows_kernel, ROWS, dict(SWIGLU=True, INTERLEAVED=False, KEEP_H=False, ROWS=quant.ROWS, **Q), 4),
    (quant._rows_kernel, ROWS, dict(SWIGLU=False, INTERLEAVED=True, KEEP_H=False, ROWS=quant.ROWS, **Q), 4),
    (quant._rows_kernel, ROWS, dict(SWIGLU=True, INTERLEAVED=False, KEEP_H=True, ROWS=quant.ROWS, **Q), 8),
    (quant._rows_kernel, ROWS, dict(SWIGLU=True, INTERLEAVED=True, KEEP_H=True, ROWS=quant.ROWS, **Q), 8),
    (quant._blocks_kernel, BLOCKS, dict(TRANSPOSE=True, WIDE=False, **Q), 8),
    (quant._blocks_kernel, BLOCKS, dict(TRANSPOSE=False, WIDE=False, **Q), 8),
    (quant._blocks_kernel, BLOCKS, dict(TRANSPOSE=True, WIDE=True, **Q), 8),
    (quant._dequant_rows_kernel, dict(q_ptr="*fp8e4nv", s_ptr="*fp32", t_ptr="*bf16"),
     dict(ROWS=quant.ROWS, GROUP=128), 4),
    (rk.rounded_tile_count_kernel, dict(kept_ptr="*i1"), dict(BLOCK_L=32, E_PAD=256), 4),
    (rk.rounded_fit_count_kernel, dict(kept_ptr="*i1"), dict(M=32, BLOCK_L=32, E_PAD=256), 4),
    (rk.rounded_place_kernel, dict(kept_ptr="*i1"), dict(M=32, M_PAD=32, BLOCK_L=32, E_PAD=256), 4),
    (rk.rounded_place_kernel, dict(kept_ptr="*i1"), dict(M=8, M_PAD=8, BLOCK_L=1024, E_PAD=8), 4),
    (rk.rounding_keys_kernel, dict(logits_ptr="*fp32", keys_ptr="*fp32", kept_ptr="*u8"),
     dict(K=8, SCORING=0, BLOCK_L=32, E_PAD=128), 4),
    (rk.rounding_select_kernel, dict(keys_ptr="*fp32", kept_ptr="*u8"), dict(RULE=0, BLOCK_T=128, BLOCK=2048,
                                                                           DIGIT=2), 16),
    (rk.rounding_over_kernel, dict(kept_ptr="*u8", over_ptr="*u8"), dict(BLOCK_L=32, E_PAD=128), 4),
    (rk.rounding_bound_kernel, dict(keys_ptr="*fp32", kept_ptr="*u8", over_ptr="*u8"),
     dict(SEL_PAD=128, BLOCK=2048, DIGIT=2), 16),
    (rk.rounded_weights_kernel, dict(logits_ptr="*fp32", topk_w_ptr="*fp32", w_ptr="*fp32", route_scale="fp32"),
     dict(K=8, M=32, M_PAD=32, SCORING=0, RENORM=True, BLOCK_L=64, E_PAD=128), 4),
    (rk.rounded_weights_backward_kernel, dict(logits_ptr="*fp32", w_ptr="*fp32", dw_ptr="*fp32",
                                              dlogits_ptr="*fp32", dtopk_w_ptr="*fp32"),
     dict(K=8, M=32, M_PAD=32, SCORING=2, RENORM=True, BLOCK_L=64, E_PAD=128), 4),
    (forward._combine_kernel, dict(rows_ptr="*bf16", weights_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16"),
     dict(K=32, WEIGHTED=True, HAS_BIAS=False, WIDE=True, K_POW2=32, BLOCK_T=16, BLOCK_D=256), 4),
    (backward._act_bwd_kernel, DH_PTRS, dict(DH, H_ALIGNED=True, QUANT_DH=True), 4),  # e4m3 H, scales per group
    (backward._act_bwd_kernel, DH_PTRS, DH, 4),  # e4m3 H, scales per element
    (backward._act_bwd_kernel, DH_PTRS, dict(DH, INTERLEAVED=True, QUANT_DH=True), 4),
    (backward._act_bwd_kernel, dict(DH_PTRS, preact_ptr="*bf16"),  # a wide table
     dict(DH, K=32, K_POW2=32, FP8_H=False, WIDE=True), 4),
]
for kernel, ptrs, consts, warps in KERNELS:
    sig = {p.name: "constexpr" if p.name in consts else ptrs.get(p.name, "*i32" if p.name.endswith("_ptr") else "i32")
           for p in kernel.params}
    ck = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=warps))
    print(kernel.fn.__name__, len(ck.asm["cubin"]) > 0)
"""


def test_tl_kernels_of_fp8_rounding_and_the_wide_combine_lower_for_sm90():
    """Each kernel of TL_SNIPPET's list (the dH pass reading H in e4m3, and reading a wide table, among them)
    compiles for sm_90."""
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(root, "src") + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", TL_SNIPPET], cwd=root, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split()
    assert lines[1::2] == ["True"] * 23 and len(lines) == 46, out.stdout
