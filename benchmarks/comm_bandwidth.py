"""The collectives' bandwidth between this host's GPUs, the numbers docs/distributed.md's cost model divides by.

    torchrun --standalone --nproc-per-node 4 benchmarks/comm_bandwidth.py --results a2a.jsonl

all_to_all: each rank sends an equal share of a bf16 buffer of --mb megabytes to every rank (all_to_all_single,
expert parallelism's transfer); all_gather: each rank contributes a 1/N share and receives the whole buffer
(FSDP2's weight gather); reduce_scatter: the reverse (its gradient reduction). Each is timed over --iters calls after
--warmup, the slowest rank's time; the figure is the bytes a rank sends to other ranks ((N - 1) / N of the buffer
for each) over that time, in GB/s (1e9 bytes). One JSON line per collective and size to stdout and to --results.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys
import time

import torch
import torch.distributed as dist

from moeblaze.cli.bench import run_env


def _collective(op: str, out: torch.Tensor, whole: torch.Tensor, share: torch.Tensor) -> None:
    if op == "all_to_all":
        dist.all_to_all_single(out, whole)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, share)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(share, whole)
    else:
        raise SystemExit(f"--ops: unknown collective {op!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", default="8,32,128,512", help="megabytes each rank sends in all, comma-separated")
    p.add_argument("--ops", default="all_to_all,all_gather,reduce_scatter", help="the collectives, comma-separated")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--results", default=None, help="append the JSON rows to this file")
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    env = run_env(torch.device("cuda"), "torchrun benchmarks/comm_bandwidth.py " + shlex.join(sys.argv[1:]))
    for op, mb in ((op, int(m)) for op in a.ops.split(",") for m in a.mb.split(",")):
        n = mb * 2**20 // 2 // world * world
        whole, share = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n // world, device="cuda",
                                                                                      dtype=torch.bfloat16)
        out = torch.empty_like(whole)
        call = functools.partial(_collective, op, out, whole, share)
        for _ in range(a.warmup):
            call()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            call()
        torch.cuda.synchronize()
        ms = torch.tensor((time.perf_counter() - t0) / a.iters * 1e3, device="cuda")
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        sent = n * 2 * (world - 1) / world
        row = dict(impl=op, world=world, mb_per_rank=mb, ms=round(ms.item(), 4),
                   gb_s=round(sent / ms.item() / 1e6, 1), nccl=".".join(map(str, torch.cuda.nccl.version())), **env)
        if rank == 0:
            print(json.dumps(row), flush=True)
            if a.results:
                with open(a.results, "a") as f:
                    f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
