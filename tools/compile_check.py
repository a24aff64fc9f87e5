"""Compile every autotune config of the expert kernels for a GPU target without a GPU (Triton's
ahead-of-time path and its bundled ptxas), and print each variant's registers, spill stack and shared
memory: a config that spills, or does not compile for the target, shows up before any GPU time is
spent. Approximate: launch-time specialisations (strides equal to 1, 16-divisible sizes) are not
applied, so the real kernels may use a few registers fewer.

    python tools/compile_check.py [--arch 90] [--kernels up,rows,down_bwd,weight_grad]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from moeblaze.experts.schedule import BLOCK_M  # noqa: E402
from moeblaze.experts.tl import TUNED_KERNELS, configs  # noqa: E402

INT32_PTRS = ("expert_token_idx_ptr", "tile_expert_ptr", "tile_row_ptr", "expert_offsets_ptr", "used_tiles_ptr")
FP32_PTRS = ("w_sorted_ptr", "ds_part_ptr")
# constexpr values the launchers pass (SwiGLU, bf16, every output stored)
LAUNCH = dict(GATED=True, ACT=0, STORE_PREACT=True, STORE_ACT=True, BLOCK_M=BLOCK_M, PRECISION="tf32",
              GROUP_M=configs.GROUP_M, DS_BLOCK=configs.DS_BLOCK, B_KMAJOR=False)
# arguments the launchers pass as 1 (contiguous last dimensions): Triton specialises them to constants
UNIT_STRIDES = {"stride_xd", "stride_wd", "stride_dyd", "stride_wh", "stride_ad", "stride_pn", "stride_qp",
                "stride_dp"}
TMA_FLAGS = ("A_TMA", "B_TMA", "W1_TMA", "W2_TMA", "DENSE_TMA")
# which descriptor a kernel reads, and its block shape from the config
DESC_BLOCK = {
    "a_desc": lambda c: (c["BLOCK_M"], c["BLOCK_K"]),
    "b_desc": lambda c: (c["BLOCK_N"], c["BLOCK_K"]) if c["B_KMAJOR"] else (c["BLOCK_K"], c["BLOCK_N"]),
    "w1_desc": lambda c: (c["BLOCK_N"], c["BLOCK_K"]),
    "w2_desc": lambda c: (c["BLOCK_K"], c["BLOCK_N"]),
    "dense_desc": lambda c: (c["BLOCK_K"], c["BLOCK_P"] if c["GATHER_P"] else c["BLOCK_N"]),
}


def variants(name):
    extra = {"weight_grad": [dict(GATHER_P=False, GATHER_Q=True), dict(GATHER_P=True, GATHER_Q=False)],
             "rows": [dict(B_KMAJOR=True), dict(B_KMAJOR=False)]}.get(name, [{}])
    for tma in (False, True):
        for e in extra:
            yield dict(e, **{f: tma for f in TMA_FLAGS})


def compile_one(kernel, cfg, launch, arch):
    fn = kernel.fn
    consts = {**LAUNCH, **launch, **cfg.kwargs}
    sig, constexprs, attrs = {}, {}, {}
    unit = UNIT_STRIDES | ({"stride_bk"} if consts.get("B_KMAJOR") else {"stride_bn"})
    for i, p in enumerate(fn.params):
        n = p.name
        if p.is_constexpr:
            if n in consts:
                constexprs[n] = consts[n]
                sig[n] = "constexpr"
            continue
        if n in unit:
            constexprs[n] = 1
            sig[n] = "constexpr"
            continue
        if not n.endswith("_desc"):  # pointers, sizes and strides: 16-divisible at our shapes
            attrs[(i,)] = [["tt.divisibility", 16]]
        if n.endswith("_desc"):
            use = any(consts.get(f) for f in TMA_FLAGS if f in [q.name for q in fn.params])
            sig[n] = f"tensordesc<bf16[{', '.join(map(str, DESC_BLOCK[n](consts)))}]>" if use else "*bf16"
        elif n.endswith("_ptr"):
            sig[n] = "*i32" if n in INT32_PTRS else "*fp32" if n in FP32_PTRS else "*bf16"
        else:
            sig[n] = "i32"
    for n in constexprs:
        sig[n] = "constexpr"
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    return ck


def resource_usage(cubin):
    """(registers, spill stack bytes per thread) from the bundled cuobjdump. ptxas places spilled
    registers in the thread's stack frame (STACK), not in LOCAL, which stays 0."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    spill = sum(int(m.group(1)) for m in (stack, local) if m)
    return (int(regs.group(1)) if regs else -1), (spill if stack or local else -1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--kernels", default=",".join(TUNED_KERNELS))
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}")
    failures = 0
    for name in args.kernels.split(","):
        kernel = TUNED_KERNELS[name]
        for launch in variants(name):
            tag = " ".join([f"{k}={int(v)}" for k, v in launch.items() if k not in TMA_FLAGS]
                           + [f"TMA={int(launch['A_TMA'])}"])
            for cfg in kernel.configs:
                try:
                    ck = compile_one(kernel, cfg, launch, args.arch)
                    regs, spill = resource_usage(ck.asm["cubin"])
                    res = f"regs {regs:>3} spill stack {spill:>5} B  smem {ck.metadata.shared // 1024:>3} KB"
                except Exception as e:  # report and go on: this is what the check is for
                    failures += 1
                    res = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:100]}"
                kw = " ".join(f"{k}={v}" for k, v in cfg.kwargs.items())
                print(f"{name:<11} {tag:<40} {kw:<60} w{cfg.num_warps} s{cfg.num_stages}  {res}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
