"""The Hopper fp8 kernel compiled ahead of time for sm_90 without a GPU (Triton's GluonASTSource and its bundled
ptxas): every variant the launcher can pick compiles, issues e4m3 wgmma, and spills nothing. What it computes is
checked on a GPU only (tests/gpu/test_fp8_gpu.py): the interpreter does not run Gluon."""
import os
import re
import subprocess
import tempfile

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget

gluon_runtime = pytest.importorskip("triton.experimental.gluon._runtime")
if not hasattr(gluon_runtime, "GluonASTSource"):
    pytest.skip("this triton has no ahead-of-time Gluon source", allow_module_level=True)

from moeblaze.experts.gluon_sm90 import fp8  # noqa: E402
from moeblaze.experts.gluon_sm90.common import descriptor  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SIZES = ("n_rows", "N", "K_DIM")  # values, not 16-divisible in general; strides and pointers are (as launched)


def _compile(gather: bool, out_dtype: torch.dtype):
    fn = fp8.fp8_rows_kernel
    a = torch.empty(1024, 512, dtype=torch.float8_e4m3fn)
    w = torch.empty(8 * 256, 512, dtype=torch.float8_e4m3fn)
    c = torch.empty(1024, 256, dtype=out_dtype)
    descs = dict(a_desc=descriptor(c if gather else a, [128, 128]), b_desc=descriptor(w, [fp8.FP8_BLOCK_N, 128]),
                 c_desc=descriptor(c, [128, fp8.FP8_BLOCK_N]))
    consts = dict(GATHER=gather, BLOCK_M=128, BLOCK_N=fp8.FP8_BLOCK_N, BLOCK_K=128, STAGES=fp8.FP8_STAGES,
                  WORKER_REGS=56)
    ptrs = dict(c_ptr="*bf16" if out_dtype == torch.bfloat16 else "*fp32", x_ptr="*fp8e4nv", sa_ptr="*fp32",
                sb_ptr="*fp32")
    sig, attrs = {}, {}
    for i, p in enumerate(fn.params):
        n = p.name
        if n in consts:
            sig[n] = "constexpr"
        elif n in descs:
            sig[n] = descs[n].__mangle__()
        else:
            sig[n] = ptrs.get(n, "*i32" if n.endswith("_ptr") else "i32")
            if n not in SIZES:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = gluon_runtime.GluonASTSource(fn, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, maxnreg=168))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gather", [False, True])
def test_fp8_rows_kernel_compiles_for_sm90_without_spills(gather, out_dtype):
    ck = _compile(gather, out_dtype)
    ptx = ck.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    assert "wgmma.wait_group.sync.aligned 1" in ptx  # the next stage's MMAs in flight while one is promoted
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True,
                               text=True, check=True).stdout
    stack = [int(s) for s in re.findall(r"STACK:(\d+)", usage)]
    assert stack and max(stack) == 0, usage
    assert ck.metadata.shared <= 227 * 1024
