"""`moeblaze train` under torchrun: the process group, the mesh, the parallel model, global means.

One process per GPU (NCCL) or per CPU rank (gloo), started by torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK
and the rendezvous). The mesh is (N / ep, ep), named ("efsdp", "ep"): moeblaze.distributed.parallelize shards the
experts over ep and FSDP2 the rest. Capacity dispatch with --on-overflow rerun shares one CapacityTracker among
every layer: after a step's backward, one all-reduce and one host read say whether any layer needed more rows
than the capacity; then the capacity grows and the step runs again from its forward (the gradients of the
overflowed pass are discarded), so no row is ever dropped silently.

Memory: what moeblaze.distributed's modules state; nothing here beyond a scalar per reduction.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist



def launched() -> bool:
    """Whether torchrun (or another launcher setting WORLD_SIZE > 1) started this process: then FSDP2 runs on
    every process, also on one (`torchrun --nproc-per-node 1`: the one-rank step, collectives included)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or dist.is_torchelastic_launched()


@dataclass
class Ranks:
    rank: int
    world: int
    ep: int
    device: torch.device
    mesh: object
    tracker: object = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of t over every rank (gloo has no AVG)."""
        t = t.detach().clone()
        dist.all_reduce(t)
        return t

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return self.sum(t) / self.world

    def max(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t


def start(device_type: str, ep: int) -> Ranks:
    """Join the process group torchrun set up and build the (efsdp, ep) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", device_id=device if device_type == "cuda"
                            else None)
    world = dist.get_world_size()
    mesh = init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    return Ranks(dist.get_rank(), world, ep, device, mesh)


def choose_layout(config, dist_run: bool):
    """(config, note): the config with the parallel layout its flags left to rule decided: ep (None: FSDP2 alone
    where the experts' gathered weights take at most an eighth of the GPU's memory, measured 1.01 of one GPU's rate
    at 2 H200s against 0.89 for ep = 2; else ep = N, the experts then never gathered), keep_gathered "auto" (yes
    where they fit so, at efsdp > 1) and reduce_dtype "auto" (bfloat16 under --dtype bfloat16, Megatron's
    default); the note says what the rule chose ("" where the flags said it all)."""
    cfg, par, machine = config.model, config.parallel, config.machine
    world = int(os.environ.get("WORLD_SIZE", "1")) if dist_run else 1
    chose = []
    reduce_dtype = par.reduce_dtype
    if reduce_dtype == "auto":
        reduce_dtype = "bfloat16" if dist_run and machine.bf16 else "float32"
        chose += [f"{reduce_dtype} gradient reductions"] if dist_run else []
    weights, memory = _experts_bytes(cfg, machine.dtype), _gpu_memory(machine.device)
    fits = memory is not None and weights <= memory / 8
    ep = par.ep
    if ep is None:
        ep = _ep_by_rule(cfg, world, memory is not None, fits)
        if world > 1:
            chose.append(f"ep {ep}: the experts' weights, {weights / 2 ** 30:.1f} GiB, "
                         + ("fit" if fits else "don't fit" if memory is not None else "no GPU to fit")
                         + " in an eighth of the GPU's memory")
    keep = par.keep_gathered in ("yes", True)
    if par.keep_gathered == "auto":
        keep = fits and world // ep > 1
        chose += [("gathered weights kept to backward" if keep else "weights regathered")] if world // ep > 1 else []
    return config.replace(parallel=dict(ep=ep, keep_gathered=keep, reduce_dtype=reduce_dtype)), "; ".join(chose)


def _ep_by_rule(cfg, world: int, gpu: bool, fits: bool) -> int:
    """ep = N where the experts' gathered weights don't fit in an eighth of a GPU's memory and the experts split
    evenly (and no token rounding, which expert parallelism does not run); 1 (FSDP2 alone) otherwise."""
    splits = world > 1 and cfg.num_experts % world == 0 and cfg.rounding is None
    return world if splits and gpu and not fits else 1


def _experts_bytes(cfg, dtype: str) -> int:
    """The routed experts' weights of every MoE block, in the training dtype's bytes."""
    from ..reference import up_width

    per_expert = (up_width(cfg.activation, cfg.d_expert) + cfg.d_expert) * cfg.d_model
    return (cfg.n_layers - cfg.dense_layers) * cfg.num_experts * per_expert * (2 if dtype == "bfloat16" else 4)


def _gpu_memory(device: str) -> int | None:
    """This process's GPU's memory in bytes (None off a GPU)."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory


def initial_capacity(ep_config, tokens: int, top_k: int, num_experts: int, ep: int) -> int:
    """ep_experts' capacity for `tokens` tokens per rank, by the rule ep_experts applies (its transport's mean rows
    per destination times the capacity factor, rounded up to 16: distributed.transports.capacity_rows)."""
    from ..distributed.transports import capacity_rows, transport

    return capacity_rows(transport(ep_config.transport), ep_config.factor, tokens, top_k, ep, num_experts // ep)


def parallelize_model(model, ranks: Ranks, config):
    """FSDP2 (+ ep on the config's EPConfig; --on-overflow rerun's CapacityTracker under capacity dispatch) on the
    model, under bf16 with bf16 parameters and the config's gradient reductions; the model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ..distributed import CapacityTracker, parallelize

    par, cfg = config.parallel, config.model
    reduce = torch.bfloat16 if par.reduce_dtype == "bfloat16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce) if config.machine.bf16 else None
    ep_kwargs = {}
    if ranks.ep > 1:
        ep_kwargs["ep_config"] = par.ep_config
        if par.ep_config.dispatch == "capacity" and par.rerun:
            ranks.tracker = CapacityTracker(initial_capacity(par.ep_config, config.schedule.tokens, cfg.top_k,
                                                             cfg.num_experts, ranks.ep))
            ep_kwargs["tracker"] = ranks.tracker
    return parallelize(model, ranks.mesh, mp_policy=mp, reshard_after_forward=not par.keep_gathered,
                       units=par.units, **ep_kwargs)


def until_no_overflow(ranks: Ranks | None, fn, log, model=None):
    """fn() once, and again after growing the capacity while any layer overflowed it (capacity dispatch with
    --on-overflow rerun); fn's result. A rerun starts from the state the first pass found: every buffer of `model`
    that a forward updates (the router's expert loads behind the expert-bias update, the layers' load counters)
    is put back first, so that the step equals one that never overflowed."""
    tracker = ranks.tracker if ranks is not None else None
    saved = [(b, b.clone()) for b in model.buffers()] if tracker is not None and model is not None else []
    while True:
        out = fn()
        if tracker is None or not tracker.overflowed():
            return out
        with torch.no_grad():
            for buf, was in saved:
                buf.copy_(was)
        old = tracker.capacity
        new = tracker.grow()
        log(f"capacity overflow: a destination needed more than {old} rows; capacity grown to {new}, step rerun")


def reshard(model) -> None:
    """Free every FSDP2 unit's gathered parameters. An evaluation's forward leaves the units that keep them gathered
    after forward (the root) gathered; an eager training step's backward would free them, a CUDA graph's replay
    does not, and the next evaluation would then run on the parameters of steps ago."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def finish(done: bool = True) -> None:
    """The process group torn down. After a run that ended well every rank first meets the others, so that none
    exits (taking its end of the collectives' connections with it) while another is still saving or talking; after
    an error it does not wait, since another rank may never come."""
    if dist.is_initialized():
        if done:
            dist.barrier()
        dist.destroy_process_group()


class StepTimer:
    """Per-step times: CUDA events on a GPU (read once, at the end: no sync per step), the host clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.a2a_bytes = 0  # this rank's expert-parallel all-to-all bytes to other ranks in the timed steps

    def _mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        import time

        return time.perf_counter()

    def start(self) -> None:
        from ..distributed.plan import Traffic

        Traffic.reset()
        self.marks.append([self._mark(), None])

    def stop(self) -> None:
        from ..distributed.plan import Traffic

        self.marks[-1][1] = self._mark()
        self.a2a_bytes += Traffic.reset()

    def times_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self.marks]
        return [(b - a) * 1e3 for a, b in self.marks]


def profile_split(step_fn, finish_fn, device: torch.device, trace: str | None = None) -> dict:
    """One more step under torch.profiler: its GPU time split (bench.timeline), and the host's costliest ops
    (self time, under the profiler's own overhead); trace: where to keep its chrome trace."""
    import shutil
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from ..bench.timeline import step_split, trace_kernels

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step_fn()
        finish_fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    host = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: -e.self_cpu_time_total)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        split = {k: round(v, 3) for k, v in step_split(trace_kernels(path)).items()}
        if trace:
            os.makedirs(os.path.dirname(os.path.abspath(trace)), exist_ok=True)
            shutil.copyfile(path, trace)
    split["host_top_ms"] = [(e.key[:60], round(e.self_cpu_time_total / 1e3, 2), e.count) for e in host[:8]]
    return split


def bench_row(config, ranks: Ranks | None, timer: StepTimer, loss: float, n_params: int, profile_fns) -> dict:
    """The results row of a --bench-steps run (every rank calls it; rank 0 writes it to the results file)."""
    import shlex
    import statistics
    import sys

    from .bench import Recorder, run_env

    sched, machine, bench = config.schedule, config.machine, config.bench
    device = ranks.device if ranks else torch.device(machine.device)
    step_ms = statistics.median(timer.times_ms())
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else 0.0
    if ranks is not None:
        both = ranks.max(torch.tensor([step_ms, peak], dtype=torch.float64, device=device))
        step_ms, peak = float(both[0]), float(both[1])
    tokens = sched.tokens
    row = dict(mode="train", preset=config.preset, model=config.model.to_dict(), **_layout(config, ranks),
               a2a_mb_per_step=round(timer.a2a_bytes / max(1, len(timer.marks)) / 2 ** 20, 2),
               compiled=machine.compile, cuda_graph=machine.cuda_graph, dtype=machine.dtype,
               batch_per_gpu=sched.batch_size, seq=sched.seq_len, tokens_per_gpu=tokens,
               params_m=round(n_params / 1e6, 1), steps=bench.steps, warmup=bench.warmup, step_ms=round(step_ms, 3),
               tokens_s_per_gpu=round(tokens / step_ms * 1e3, 1), peak_gb=round(peak, 3), loss=loss,
               status="ok")
    if profile_fns is not None:
        trace = bench.trace and bench.trace + (f".rank{ranks.rank}" if ranks and ranks.rank else "")
        row["split"] = profile_split(*profile_fns, device, trace)
    launcher = f"torchrun --nproc-per-node {row['world']} -m moeblaze.cli " if ranks else "moeblaze "
    env = run_env(device, launcher + shlex.join(sys.argv[1:]))
    if ranks is None or ranks.main:
        row = Recorder(bench.results, env).add(row)
    return row


def _layout(config, ranks: Ranks | None) -> dict:
    """A results row's fields of the parallel layout: processes, ep, the transport, FSDP2's settings."""
    par = config.parallel
    world, ep = (ranks.world, ranks.ep) if ranks else (1, 1)
    fields = dict(world=world, ep=ep, efsdp=world // ep, dispatch=par.ep_config.dispatch if ep > 1 else "-",
                  transport=par.ep_config.transport if ep > 1 else "-", keep_gathered=bool(ranks and par.keep_gathered),
                  fsdp_units=par.units if ranks else "-", ep_chunks=par.ep_config.chunks,
                  reduce_dtype=par.reduce_dtype if ranks else "-")
    if ep > 1 and par.ep_config.dispatch == "capacity":
        fields.update(capacity_factor=par.ep_config.factor, on_overflow=par.on_overflow,
                      capacity=ranks.tracker.capacity if ranks.tracker is not None else None)
    return fields


def format_row(r: dict) -> str:
    split = r.get("split")
    parts = "" if not split else " | " + ", ".join(f"{k[:-3]} {v:.1f} ms" for k, v in split.items()
                                                   if k != "host_top_ms")
    return (f"bench: {r['world']} x {r.get('gpu', 'cpu')} (efsdp {r['efsdp']} x ep {r['ep']}, {r['dispatch']}"
            f"{', ' + r['transport'] if r['ep'] > 1 else ''}, {r['a2a_mb_per_step']} MB all-to-all a step): "
            f"step {r['step_ms']:.1f} ms, {r['tokens_s_per_gpu']:,.0f} tokens/s per GPU, peak {r['peak_gb']:.2f} GB, "
            f"loss {r['loss']:.4f}{parts}" + (f"\n  host's costliest ops (ms, calls): {split['host_top_ms']}"
                                              if split else ""))
