"""The all-to-all's bandwidth between this host's GPUs, the number docs/distributed.md's cost model divides by.

    torchrun --standalone --nproc-per-node 4 benchmarks/a2a_bandwidth.py --results a2a.jsonl

Each rank sends an equal share of a bf16 buffer to every rank (all_to_all_single, NCCL), timed over --iters calls
after --warmup; the figure is the bytes a rank sends to other ranks over the time, in GB/s (1e9 bytes), the
slowest rank's time. One JSON line per message size to stdout and to --results.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import torch
import torch.distributed as dist

from moeblaze.cli.bench import run_env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", default="8,32,128,512", help="megabytes each rank sends in all, comma-separated")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--results", default=None, help="append the JSON rows to this file")
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    env = run_env(torch.device("cuda"), "torchrun benchmarks/a2a_bandwidth.py " + shlex.join(sys.argv[1:]))
    for mb in (int(m) for m in a.mb.split(",")):
        n = mb * 2**20 // 2 // world * world
        src, dst = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda",
                                                                                  dtype=torch.bfloat16)
        for _ in range(a.warmup):
            dist.all_to_all_single(dst, src)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            dist.all_to_all_single(dst, src)
        torch.cuda.synchronize()
        ms = torch.tensor((time.perf_counter() - t0) / a.iters * 1e3, device="cuda")
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        sent = n * 2 * (world - 1) / world
        row = dict(impl="all_to_all", world=world, mb_per_rank=mb, ms=round(ms.item(), 4),
                   gb_s=round(sent / ms.item() / 1e6, 1), nccl=".".join(map(str, torch.cuda.nccl.version())), **env)
        if rank == 0:
            print(json.dumps(row), flush=True)
            if a.results:
                with open(a.results, "a") as f:
                    f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
