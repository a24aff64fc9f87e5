"""What a weight-gradient tile costs on Hopper when each expert has few rows (256 experts: ~256 rows each, a handful
of 64-row steps per 128 x 256 tile of dW): the bf16 Gluon kernel (experts/gluon_sm90/wgrad.py) on the two shapes of
(16384, 4096, 1024, 256, 4), dW1 = dHᵀ x[token] and dW2 = dy[token]ᵀ (s·A), with every expert given the same R_e
rows (R_e = 128 .. 1024) and with a top-k routing's ragged counts; beside cuBLAS's batched GEMM on the same dense
operands (the gathered side gathered beforehand, so it reads less than the kernel does): a yardstick for short
reductions. Each shape's impls are timed in turns (moeblaze.bench.harness). From the aligned rows, the kernel's
time per tile and SM is fitted as fixed + per_step · steps: what a tile costs beyond its MMAs.

  gluon          the kernel as the experts run it (BLOCK_K 64, 3 stages)
  gluon-k32-s6   BLOCK_K 32 and 6 stages: the same bytes in flight, finer steps
  bmm            torch.bmm (E, M, R_e) x (E, R_e, N), aligned rows only

With --fp8 CONFIGS (e.g. B,D,E): at those configs' shapes and a top-k routing, what the fp8 weight gradients
(fp8_wgrad) cost against the bf16 kernel: bf16 (the bf16 Gluon kernel), fp8-gemm (gluon_sm90.fp8_weight_grad on
operands quantized beforehand), fp8-gemm-one (the same with its MMA warps as one 8-warp partition, split=False;
equal_to_split: its result is fp8-gemm's, bitwise), fp8-quant (quant.quantize_tiles_t of both operands:
transposed, per 128 of an expert's rows) and fp8 (both, what the step pays); rel_to_gluon is fp8-gemm's error
against bf16's result.

    python scripts/wgrad_lab.py [--out DIR] [--rows 128,256,512,1024]   (Hopper; rows in DIR/wgrad_lab.jsonl)
    python scripts/wgrad_lab.py --fp8 B,D,E [--out DIR]
    ncu ... python scripts/wgrad_lab.py --once [--fp8 D]  each Gluon impl launched once per shape on the top-k
                                                         routing, untimed (for a profiler)
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch

from moeblaze.bench.harness import _timed_rounds
from moeblaze.cli.bench import run_env
from moeblaze.experts import gluon_sm90
from moeblaze.experts.stages import RowPlan
from moeblaze.launch import sm_count
from moeblaze.routing import build_routing_index, route_topk

L, D, H, E, K = 16384, 4096, 1024, 256, 4


def shapes():
    """(name, M, N, gather_p): dW[e] (M, N) = Pᵀ Q, P gathered through the token ids where gather_p, else Q."""
    return (("dW1", 2 * H, D, False), ("dW2", D, H, True))


def operands(M, N, gather_p, R):
    """p, q as the experts' backward passes them: the gathered side is (L, width), the dense side (R, width)."""
    g = torch.Generator(device="cuda").manual_seed(R)
    p = torch.randn(L if gather_p else R, M, device="cuda", generator=g).bfloat16()
    q = torch.randn(R if gather_p else L, N, device="cuda", generator=g).bfloat16()
    return p, q


def impls(p, q, token, offsets, out, gather_p, r_e) -> dict:
    """{impl: step(i)} on one shape (see the module header); bmm where every expert has r_e rows."""
    fns = {"gluon": lambda i: gluon_sm90.weight_grad(p, q, token, offsets, out, gather_p),
           "gluon-k32-s6": lambda i: gluon_sm90.weight_grad(p, q, token, offsets, out, gather_p, block_k=32,
                                                             stages=6)}
    if r_e is not None:
        E, M, N = out.shape
        pe = (p[token.long()] if gather_p else p).view(E, r_e, M).transpose(1, 2)
        qe = (q if gather_p else q[token.long()]).view(E, r_e, N)
        bmm_out = torch.empty_like(out)
        fns["bmm"] = lambda i: torch.bmm(pe, qe, out=bmm_out)
    return fns


def topk_plan():
    """(token, offsets) of a top-k routing of random logits."""
    idx, _ = route_topk(torch.randn(L, E, device="cuda"), K)
    plan = RowPlan.build(build_routing_index(idx, E))
    return plan.token_R, plan.offsets_E1


def launch_once(fp8_configs=()):
    """Each Gluon impl once per shape on the top-k routing, after one launch of each to compile; with fp8_configs,
    the fp8 weight gradient (split, then one partition) once per shape of those configs instead."""
    if fp8_configs:
        return fp8_measure(fp8_configs, None, once=True)
    torch.manual_seed(0)
    token, offsets = topk_plan()
    for name, M, N, gather_p in shapes():
        p, q = operands(M, N, gather_p, token.numel())
        out = torch.empty(E, M, N, device="cuda", dtype=torch.bfloat16)
        fns = {k: f for k, f in impls(p, q, token, offsets, out, gather_p, None).items() if k != "bmm"}
        for fn in fns.values():
            fn(0)
        torch.cuda.synchronize()
        for impl, fn in fns.items():
            torch.cuda.nvtx.range_push(f"{name} {impl}")
            fn(0)
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(name, "launched:", ", ".join(fns), flush=True)


def measure(rows_per_expert, meta) -> list:
    out_rows = []
    sms = sm_count(torch.device("cuda"))
    torch.manual_seed(0)
    cases = [(f"aligned-{r}", r) for r in rows_per_expert] + [("top-k", None)]
    for case, r_e in cases:
        if r_e is None:
            token, offsets = topk_plan()
        else:
            token = torch.randint(0, L, (E * r_e,), device="cuda", dtype=torch.int32)
            offsets = (torch.arange(E + 1, device="cuda", dtype=torch.int32) * r_e)
        R = token.numel()
        steps = int(((offsets[1:] - offsets[:-1] + 63) // 64).sum()) / E  # 64-row steps per tile, mean over experts
        for name, M, N, gather_p in shapes():
            p, q = operands(M, N, gather_p, R)
            out = torch.empty(E, M, N, device="cuda", dtype=torch.bfloat16)
            fns = impls(p, q, token, offsets, out, gather_p, r_e)
            want = fns["gluon"](0).float()
            same = {}
            for impl, fn in list(fns.items()):
                if impl == "gluon":
                    continue
                try:
                    got = fn(0).float()
                    same[impl] = float((got - want).norm() / want.norm())
                except Exception as ex:  # noqa: BLE001  (a variant that fails is reported, the others run)
                    print(f"{case} {name} {impl}: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                    fns.pop(impl)
            tiles = E * -(-M // 128) * -(-N // 256)
            for impl, res in _timed_rounds(fns, torch.device("cuda"), iters=10).items():
                if isinstance(res, Exception):
                    print(f"{case} {name} {impl}: {res}", flush=True)
                    continue
                ms = res[0]
                row = dict(mode="wgrad-lab", case=case, gemm=name, E=E, M=M, N=N, R=R, steps_per_tile=round(steps, 3),
                           impl=impl, ms=round(ms, 4), tflops=round(2 * R * M * N / (ms * 1e-3) / 1e12, 1),
                           us_per_tile_sm=round(ms * 1e3 / (tiles / sms), 3), rel_to_gluon=same.get(impl), **meta)
                out_rows.append(row)
                print(json.dumps(row), flush=True)
            del p, q, out, fns
            torch.cuda.empty_cache()
    return out_rows


def fp8_measure(configs, meta, once: bool = False) -> list:
    """The --fp8 rows (see the module header); once: each fp8 GEMM launched instead, untimed, no rows."""
    from moeblaze.bench.harness import CONFIGS
    from moeblaze.experts.schedule import tile_schedule

    out_rows = []
    for config in configs:
        Lc, d, h, Ec, Kc = CONFIGS[config]
        torch.manual_seed(0)
        idx, _ = route_topk(torch.randn(Lc, Ec, device="cuda"), Kc)
        plan = RowPlan.build(build_routing_index(idx, Ec))
        offsets = plan.offsets_E1
        sched = tile_schedule(offsets[1:] - offsets[:-1], offsets, plan.num_rows, 128)
        for name, M, N, gather_p in (("dW1", 2 * h, d, False), ("dW2", d, h, True)):
            tag = dict(config=config, gemm=name, E=Ec, M=M, N=N, R=plan.num_rows)
            out_rows += _fp8_case(Lc, plan, sched, M, N, gather_p, tag, meta, once)
            torch.cuda.empty_cache()
    return out_rows


def _fp8_case(Lc, plan, sched, M, N, gather_p, tag, meta, once: bool) -> list:
    from moeblaze.experts.tl import quant

    token, offsets, R = plan.token_R, plan.offsets_E1, plan.num_rows
    g = torch.Generator(device="cuda").manual_seed(1)
    p = torch.randn(Lc if gather_p else R, M, device="cuda", generator=g).bfloat16()
    q = torch.randn(R if gather_p else Lc, N, device="cuda", generator=g).bfloat16()
    out = torch.empty(tag["E"], M, N, device="cuda", dtype=torch.bfloat16)
    out8, out1 = torch.empty_like(out), torch.empty_like(out)

    def quantized():
        return (quant.quantize_tiles_t(p, sched, offsets, token if gather_p else None),
                quant.quantize_tiles_t(q, sched, offsets, None if gather_p else token))
    pt, qt = quantized()
    fns = {"bf16": lambda i: gluon_sm90.weight_grad(p, q, token, offsets, out, gather_p),
           "fp8-gemm": lambda i: gluon_sm90.fp8_weight_grad(pt, qt, offsets, out8),
           "fp8-gemm-one": lambda i: gluon_sm90.fp8_weight_grad(pt, qt, offsets, out1, split=False),
           "fp8-quant": lambda i: quantized(),
           "fp8": lambda i: gluon_sm90.fp8_weight_grad(*quantized(), offsets, out8)}
    if once:  # each fp8 GEMM launched once after a launch to compile, for a profiler
        for fn in (fns["fp8-gemm"], fns["fp8-gemm-one"], fns["fp8-gemm"], fns["fp8-gemm-one"]):
            fn(0)
        torch.cuda.synchronize()
        print(tag, "launched: fp8-gemm, fp8-gemm-one (twice each)", flush=True)
        return []
    want = fns["bf16"](0).float()
    err = float((fns["fp8-gemm"](0).float() - want).norm() / want.norm())
    same = bool(torch.equal(fns["fp8-gemm-one"](0), out8))  # the same arithmetic, split or not
    rows = []
    for impl, res in _timed_rounds(fns, torch.device("cuda"), iters=10).items():
        if isinstance(res, Exception):
            print(f"{tag} {impl}: {res}", flush=True)
            continue
        ms = res[0]
        rows.append(dict(mode="wgrad-lab-fp8", **tag, impl=impl, ms=round(ms, 4),
                         tflops=round(2 * R * M * N / (ms * 1e-3) / 1e12, 1),
                         rel_to_gluon=err if impl == "fp8-gemm" else None,
                         equal_to_split=same if impl == "fp8-gemm-one" else None, **meta))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def fit(rows) -> list:
    """Per (gemm, impl): us per tile and SM = fixed + per_step · steps, least squares over the aligned cases."""
    out = []
    for gemm in ("dW1", "dW2"):
        for impl in ("gluon", "gluon-k32-s6"):
            pts = [(r["steps_per_tile"], r["us_per_tile_sm"]) for r in rows
                   if r["gemm"] == gemm and r["impl"] == impl and r["case"].startswith("aligned")]
            if len(pts) < 2:
                continue
            x = torch.tensor([p[0] for p in pts], dtype=torch.float64)
            y = torch.tensor([p[1] for p in pts], dtype=torch.float64)
            A = torch.stack([torch.ones_like(x), x], 1)
            fixed, per_step = torch.linalg.lstsq(A, y[:, None]).solution[:, 0].tolist()
            out.append(dict(mode="wgrad-lab-fit", gemm=gemm, impl=impl, fixed_us=round(fixed, 3),
                            per_step_us=round(per_step, 3)))
            print(json.dumps(out[-1]), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default="128,256,512,1024", help="rows per expert of the aligned cases")
    ap.add_argument("--once", action="store_true", help="launch each Gluon impl once per shape, untimed")
    ap.add_argument("--fp8", default="", help="configs (e.g. B,D,E): the fp8 weight gradients against bf16 there")
    args = ap.parse_args()
    if args.once:
        return launch_once(args.fp8.split(",") if args.fp8 else ())
    os.makedirs(args.out, exist_ok=True)
    meta = run_env(torch.device("cuda"), shlex.join(["python", "scripts/wgrad_lab.py", *sys.argv[1:]]))
    if args.fp8:
        rows = fp8_measure(args.fp8.split(","), meta)
    else:
        rows = measure([int(r) for r in args.rows.split(",")], meta)
        rows += [dict(r, **meta) for r in fit(rows)]
    with open(os.path.join(args.out, "wgrad_lab.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
