"""What limits the fp8 Hopper GEMM (experts/gluon_sm90/fp8.py): the kernel timed beside variants of its launch, on
a config's four expert GEMM shapes (up and dA' gathered, down and dX~ in place), with the bf16 Gluon row GEMMs on
the same shapes. Each shape's variants are timed in turns (moeblaze.bench.harness), and each fp8 variant's output
is compared with the kernel's (equal_to_fp8: they do the same arithmetic).

  fp8        the kernel as the experts run it (A in place read by TMA)
  fp8-gather A in place read by the gathering loader through identity tokens (tma_a=False); in-place shapes
  fp8-1buf   one C staging buffer per warpgroup instead of two (a tile's second half waits for the first's store)
  fp8-one    the MMA warps as one 8-warp partition (split=False), both warpgroups in step
  fp8-base   an earlier commit's kernel (bash scripts/make_baseline.sh REV; carry .baseline), where present
  bf16       gluon_sm90.gathered_rows_gemm / rows_gemm on the same shape, bf16 operands

With --dh, the dH pass of the fp8 step instead (tl.act_bwd with dH quantized as it is stored), on the step's
tensors, at launch shapes (rows a program x warps; 8x4 first, the default before 2x2 and 4x4), beside the pass
without the quantization; each variant's outputs compared with 8x4's.

With --quantizers, the quantizers instead (experts/tl/quant.py), on the step's tensors, beside a copy of each input
(torch's clone: what this GPU's memory moves): x and dH by quantize_rows, H by swiglu_quantize (and with H kept),
W1 and W2 by quantize_blocks (plain, transposed, both layouts). Their GB/s count the bytes read and written once.

    python scripts/fp8_kernel_lab.py [--out DIR] [--configs D] [--impls fp8,fp8-1buf] [--quantizers | --dh]
                                     (Hopper; rows in DIR/fp8_kernel_lab.jsonl)
    ncu ... python scripts/fp8_kernel_lab.py --once ...   each GEMM variant launched once per shape, untimed
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch

from moeblaze.bench.harness import CONFIGS, _timed_rounds
from moeblaze.cli.bench import run_env
from moeblaze.experts import gluon_sm90
from moeblaze.experts.stages import RowPlan
from moeblaze.experts.tl import quant
from moeblaze.routing import build_routing_index, route_topk

BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".baseline")
BASE = None
if os.path.isdir(os.path.join(BASELINE, "moeblaze_base")):  # scripts/make_baseline.sh
    sys.path.insert(0, BASELINE)
    import moeblaze_base as BASE


def variants(a, w, plan, R, gathered) -> dict:
    """{impl: step(i)} on one shape (see the module header)."""
    aq, wq = quant.quantize_rows(a), quant.quantize_blocks(w)
    tok = plan.token_R if gathered else None
    args = (*aq, *wq, R, plan.offsets_E1, plan.sched)
    fns = {"fp8": lambda i: gluon_sm90.fp8_rows_gemm(*args, tok, torch.bfloat16),
           "fp8-1buf": lambda i: gluon_sm90.fp8_rows_gemm(*args, tok, torch.bfloat16, store_bufs=1),
           "fp8-one": lambda i: gluon_sm90.fp8_rows_gemm(*args, tok, torch.bfloat16, split=False)}
    if BASE is not None:
        fns["fp8-base"] = lambda i: BASE.experts.gluon_sm90.fp8_rows_gemm(*args, tok, torch.bfloat16)
    if not gathered:
        fns["fp8-gather"] = lambda i: gluon_sm90.fp8_rows_gemm(*args, None, torch.bfloat16, tma_a=False)
        fns["bf16"] = lambda i: gluon_sm90.rows_gemm(a, w, plan.offsets_E1, plan.sched)
    else:
        w_kn = w.transpose(1, 2).contiguous()  # the gathering bf16 GEMM takes W (E, K, N)
        fns["bf16"] = lambda i: gluon_sm90.gathered_rows_gemm(a, w_kn, plan.token_R, plan.offsets_E1, plan.sched)
    return fns


def measure(config, meta, impls=None, once=False, gemms=None) -> list:
    L, d, h, E, K = CONFIGS[config]
    torch.manual_seed(0)
    idx, _ = route_topk(torch.randn(L, E, device="cuda"), K)
    plan = RowPlan.build(build_routing_index(idx, E))
    R = L * K
    rows = []
    # (gemm, A's rows, N, K, gathered): C (R, N) = A[token or rows] · W[e]ᵀ, W (E, N, K)
    for gemm, m_src, n, kd, gathered in (("up", L, 2 * h, d, True), ("down", R, d, h, False),
                                         ("dA'", L, h, d, True), ("dX~", R, d, 2 * h, False)):
        if gemms and gemm not in gemms:
            continue
        a = torch.randn(m_src, kd, device="cuda").bfloat16()
        w = (torch.randn(E, n, kd, device="cuda") * kd ** -0.5).bfloat16()
        fns = variants(a, w, plan, R, gathered)
        if impls:
            fns = {i: f for i, f in fns.items() if i in impls or i == "fp8"}
        if once:  # for a profiler: each variant launched once, nothing timed
            for fn in fns.values():
                fn(0)
            torch.cuda.synchronize()
            continue
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


def _bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _flat(out) -> list:
    return [t for o in (out if isinstance(out, tuple) else (out,))
            for t in (_flat(o) if isinstance(o, tuple) else [o])]


def _bitwise_equal(a, b) -> bool:
    """Whether two outputs (tensors or nested tuples of them, e4m3 ones too) are equal bit for bit."""
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.element_size() == 1 else torch.equal(x, y)
               for x, y in zip(_flat(a), _flat(b), strict=True))


def measure_quantizers(config, meta) -> list:
    """Each quantizer against a clone of its input (see the module header)."""
    L, d, h, E, K = CONFIGS[config]
    R = L * K
    torch.manual_seed(0)
    x = torch.randn(L, d, device="cuda").bfloat16()
    H = torch.randn(R, 2 * h, device="cuda").bfloat16()
    w1 = (torch.randn(E, 2 * h, d, device="cuda") * d ** -0.5).bfloat16()
    w2 = (torch.randn(E, d, h, device="cuda") * h ** -0.5).bfloat16()
    cases = {  # name: (input, fn)
        "x rows": (x, lambda: quant.quantize_rows(x)),
        "dH rows": (H, lambda: quant.quantize_rows(H)),
        "H swiglu": (H, lambda: quant.swiglu_quantize(H)),
        "H swiglu+keep": (H, lambda: quant.swiglu_quantize(H, keep_preact=True)),
        "W1 blocks": (w1, lambda: quant.quantize_blocks(w1)),
        "W1 blocks-t": (w1, lambda: quant.quantize_blocks(w1, transpose=True)),
        "W1 blocks-both": (w1, lambda: quant.quantize_blocks(w1, both=True)),
        "W2 blocks": (w2, lambda: quant.quantize_blocks(w2)),
        "W2 blocks-t": (w2, lambda: quant.quantize_blocks(w2, transpose=True)),
        "W2 blocks-both": (w2, lambda: quant.quantize_blocks(w2, both=True)),
    }
    if BASE is not None:  # the same quantizers of an earlier commit (scripts/make_baseline.sh REV)
        bq = BASE.experts.tl.quant
        cases.update({"W1 blocks (base)": (w1, lambda: bq.quantize_blocks(w1)),
                      "W1 blocks-t (base)": (w1, lambda: bq.quantize_blocks(w1, transpose=True)),
                      "W1 blocks-both (base)": (w1, lambda: bq.quantize_blocks(w1, both=True))})
    rows = []
    for name, (t, fn) in cases.items():
        moved = _bytes(t, *_flat(fn()))
        same = None
        if name.endswith(" (base)"):  # bit for bit what the kernel as launched writes
            ours = cases[name.removesuffix(" (base)")][1]
            same = _bitwise_equal(fn(), ours())
        copy_name = f"copy {name.split()[0]}"
        fns = {name: lambda i, fn=fn: fn(), copy_name: lambda i, t=t: t.clone()}
        for impl, res in _timed_rounds(fns, torch.device("cuda"), iters=10).items():
            if isinstance(res, Exception):
                print(f"{config} {impl}: {res}", flush=True)
                continue
            nbytes = 2 * _bytes(t) if impl == copy_name else moved
            row = dict(mode="fp8-quant-lab", config=config, op=impl, shape=list(t.shape), ms=round(res[0], 4),
                       gbps=round(nbytes / (res[0] * 1e-3) / 1e9, 1), **meta)
            if impl == name and same is not None:
                row["equal_to_kernel"] = same
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def measure_dh(config, meta) -> list:
    """The dH pass at launch shapes (see the module header)."""
    from moeblaze.experts.tl import launchers

    L, d, h, E, K = CONFIGS[config]
    torch.manual_seed(0)
    idx, w = route_topk(torch.randn(L, E, device="cuda"), K)
    plan = RowPlan.build(build_routing_index(idx, E))
    R = L * K
    dact = torch.randn(R, h, device="cuda").bfloat16()
    preact = torch.randn(R, 2 * h, device="cuda").bfloat16()
    outs = {}

    def variant(block_r, warps, quant_dh=True):
        sa, dpre = torch.empty_like(dact), torch.empty_like(preact)
        q = (torch.empty(preact.shape, dtype=torch.float8_e4m3fn, device="cuda"),
             torch.empty(R, 2 * h // 128, device="cuda")) if quant_dh else None
        outs[(block_r, warps, quant_dh)] = (sa, dpre, q)

        def fn(i):  # s·A into a buffer of its own (the step writes it over dA': the same traffic)
            return launchers.act_bwd(dact, preact, plan.token_R, plan.token_slot_LK, w, dpre, sa, "swiglu",
                                     dpreact_q=q, block_r=block_r, num_warps=warps)
        return fn
    shapes = [(8, 4), (4, 4), (2, 4), (4, 2), (2, 2)]  # 16 rows or 8 warps: no faster (run 44d25c578d54)
    fns = {f"dh-q {r}x{n}": variant(r, n) for r, n in shapes}
    fns.update({f"dh {r}x{n}": variant(r, n, quant_dh=False) for r, n in shapes[:3]})
    fns["copy dA'"] = lambda i: dact.clone()
    for fn in fns.values():
        fn(0)
    ref = outs[(8, 4, True)]
    rows = []
    moved = {True: 2 * dact.numel() * 2 + preact.numel() * 2 * 2 + preact.numel() * (1 + 4 / 128),
             False: 2 * dact.numel() * 2 + preact.numel() * 2 * 2}
    for impl, res in _timed_rounds(fns, torch.device("cuda"), iters=10).items():
        if isinstance(res, Exception):
            print(f"{config} {impl}: {res}", flush=True)
            continue
        same = None
        if impl.startswith("dh-q"):
            r, n = (int(v) for v in impl.split()[1].split("x"))
            same = _bitwise_equal(outs[(r, n, True)], ref)
        nbytes = 2 * dact.numel() * 2 if impl.startswith("copy") else moved[impl.startswith("dh-q")]
        row = dict(mode="fp8-dh-lab", config=config, op=impl, ms=round(res[0], 4),
                   gbps=round(nbytes / (res[0] * 1e-3) / 1e9, 1), equal_to_default=same, **meta)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--configs", default="D")
    ap.add_argument("--quantizers", action="store_true", help="time the quantizers instead of the GEMM")
    ap.add_argument("--dh", action="store_true", help="time the dH pass at launch shapes instead of the GEMM")
    ap.add_argument("--impls", default=None, help="the GEMM variants to run, comma-separated (fp8 always)")
    ap.add_argument("--gemms", default=None, help="the GEMMs to run, comma-separated (default up,down,dA',dX~)")
    ap.add_argument("--once", action="store_true", help="launch each GEMM variant once, untimed (for ncu)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    meta = run_env(torch.device("cuda"), shlex.join(["python", "scripts/fp8_kernel_lab.py", *sys.argv[1:]]))
    if BASE is not None:
        meta["baseline"] = open(os.path.join(BASELINE, "REV")).read().strip()
    if args.quantizers or args.dh:
        fn = measure_quantizers if args.quantizers else measure_dh
        rows = [r for c in args.configs.split(",") for r in fn(c, meta)]
    else:
        impls = args.impls.split(",") if args.impls else None
        gemms = args.gemms.split(",") if args.gemms else None
        rows = [r for c in args.configs.split(",") for r in measure(c, meta, impls, args.once, gemms)]
    with open(os.path.join(args.out, "fp8_kernel_lab.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
