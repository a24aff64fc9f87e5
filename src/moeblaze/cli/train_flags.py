"""The flags of `moeblaze train` and the checks that read only them, torch-free: `moeblaze train` parses and refuses
a bad flag before torch loads (status 2, one line naming the flag, as argparse does). The checks that ask the
machine (the device, the backend, the processes, the files) follow in cli/train_setup.py.

Memory: none beyond the parsed arguments.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from ..args import check_choice, check_int
from ..configs import (ACTIVATIONS, BACKENDS, CHECKPOINTS, DISPATCHES, INDEX_METHODS, OVERFLOW, PRECISIONS, ROUTERS,
                       RULES, UNITS, WIRES, EPConfig, ExpertsConfig, ModelConfig, RouterConfig, flat_rounding,
                       flat_shared, fold_impl)
from . import UsageError
from .presets import EXTRAS, PRESETS, SHAPE
from .train_config import Bench, Machine, Outputs, Parallel, Schedule, TrainConfig

ON_OVERFLOW = ("rerun", *OVERFLOW)  # --on-overflow: EPConfig's, or rerun the step with a larger capacity


def add_experts_arguments(p) -> None:
    """The experts' recipe (moeblaze.ExpertsConfig) as flags; experts_config maps them back."""
    d = ExpertsConfig()
    p.add_argument("--activation", default=d.activation, choices=ACTIVATIONS,
                   help=f"the experts' activation (default {d.activation})")
    p.add_argument("--backend", default=d.backend, choices=BACKENDS,
                   help="auto (the kernels on CUDA, the PyTorch reference elsewhere), reference, triton (the "
                        "kernels: Gluon on Hopper, tl elsewhere), tl or gluon (default auto)")
    p.add_argument("--impl", default=None, choices=("auto", "triton", "reference"),
                   help="deprecated: --backend (impl triton is --backend triton, reference --backend reference)")
    p.add_argument("--checkpoint-policy", default=d.checkpoint, choices=CHECKPOINTS,
                   help="what the experts keep for backward: preact (default), preact-fp8, recompute")
    p.add_argument("--precision", default=d.precision, choices=PRECISIONS,
                   help="fp8: the routed experts' data GEMMs on e4m3 with 1x128 / 128x128 scales (sm_89+); "
                        "default native")
    p.add_argument("--fp8-weight-cache", action="store_true",
                   help="with --precision fp8: quantize the experts' weights once per optimizer step (both layouts) "
                        "and keep the e4m3 copies in between, instead of where each GEMM uses them")
    p.add_argument("--fp8-min-rows", type=int, default=d.fp8_min_rows,
                   help="with --precision fp8: the fewest rows per expert a call runs on e4m3 (fewer: native "
                        f"precision; 0: always e4m3; default {d.fp8_min_rows})")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="run the experts on chunks of this many tokens (default: one chunk)")
    p.add_argument("--index-method", default=d.index_method, choices=INDEX_METHODS,
                   help="the routing index's build: auto (default), dense (sort-free) or sort")


def backend_flag(args: argparse.Namespace) -> str:
    """ExpertsConfig.backend of --backend, and of the deprecated --impl folded into it (once, into args: one note on
    stderr however often the recipe is read)."""
    if args.impl is not None:
        args.backend, args.impl = fold_impl(args.impl, args.backend), None
        print(f"note: --impl is deprecated and goes in 0.3: say --backend {args.backend}", file=sys.stderr)
    return args.backend


def experts_config(args: argparse.Namespace) -> ExpertsConfig:
    """The recipe the flags of add_experts_arguments say (ValueError or TypeError naming the choice)."""
    backend = backend_flag(args)
    return ExpertsConfig(activation=args.activation, checkpoint=args.checkpoint_policy, backend=backend,
                         precision=args.precision, fp8_weight_cache=args.fp8_weight_cache,
                         fp8_min_rows=args.fp8_min_rows,
                         chunk_tokens=args.chunk_tokens, index_method=args.index_method)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = PRESETS["small"]
    m = p.add_argument_group("model")
    m.add_argument("--preset", default="small", choices=tuple(PRESETS),
                   help="model shape (default small); the shape flags below override it")
    m.add_argument("--seq-len", type=int, default=None, help=f"default {d['seq_len']} (small)")
    m.add_argument("--d-model", type=int, default=None, help=f"default {d['d_model']} (small)")
    m.add_argument("--n-layers", type=int, default=None, help=f"default {d['n_layers']} (small)")
    m.add_argument("--n-heads", type=int, default=None, help=f"default {d['n_heads']} (small)")
    m.add_argument("--num-experts", type=int, default=None, help=f"default {d['num_experts']} (small)")
    m.add_argument("--top-k", type=int, default=None, help=f"default {d['top_k']} (small)")
    m.add_argument("--d-expert", type=int, default=None, help=f"default {d['d_expert']} (small)")
    m.add_argument("--shared-experts", type=int, default=None, help="always-on experts per MoE layer (default 0)")
    m.add_argument("--d-shared", type=int, default=None, help="their width (default: --d-expert)")
    m.add_argument("--shared-gate", action="store_const", const=True, default=None,
                   help="scale the shared experts' output by a learned sigmoid gate of x")
    m.add_argument("--dense-layers", type=int, default=None,
                   help="dense feed-forward in the first N blocks (fewer than --n-layers)")
    m.add_argument("--router", default=None, choices=tuple(ROUTERS),
                   help="a model family's routing (score function, scale, biases, groups, balancing loss; default: "
                        "softmax top-k, renormalized, switch loss); deepseek-v3's expert bias is updated after every "
                        "optimizer step")
    m.add_argument("--token-rounding", default=None, choices=RULES, metavar="{" + ",".join(RULES) + "}",
                   help="SonicMoE's token rounding while training: every expert's tokens a multiple of the tile; "
                        "evaluation routes plain top-k (default: off)")
    m.add_argument("--rounding-tile", type=int, default=None, help="its tile (default: the kernels' row tile, 128)")
    add_experts_arguments(p.add_argument_group("experts (moeblaze.ExpertsConfig)"))
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    t.add_argument("--batch-size", type=int, default=16, help="sequences per step (per process under torchrun)")
    t.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    t.add_argument("--aux-loss-coef", type=float, default=1e-2, help="weight of the router's balancing loss")
    t.add_argument("--z-loss-coef", type=float, default=1e-3, help="weight of the router's z-loss")
    t.add_argument("--eval-every", type=int, default=250, help="evaluate on held-out text every N steps")
    t.add_argument("--eval-batches", type=int, default=8, help="batches per evaluation")
    t.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="where to train (default: cuda where a GPU is available, else cpu)")
    t.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype; bfloat16 runs under CUDA autocast (and FSDP2 keeps bf16 parameters with "
                        "fp32 gradient reductions under torchrun)")
    t.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batches")
    t.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch on --device cpu (default 2, or 1 on one core, unless OMP_NUM_THREADS "
                        "is set; where other processes keep the cores busy, the threads wait passively: docs/cli.md)")
    t.add_argument("--compile", action="store_true", help="torch.compile each block (GPU; under torchrun before "
                   "FSDP2 wraps it): fewer launches and less host time per step")
    t.add_argument("--cuda-graph", action="store_true",
                   help="(GPU) capture the training step (forward, backward, clipping; FSDP2's collectives too) in a "
                        "CUDA graph at the second step and replay it after: one launch a step plus the optimizer's, "
                        "for a model whose step is paced by the host. Every step has the same shapes; no host sync "
                        "may run inside it: --ep > 1 needs --ep-dispatch capacity with --on-overflow drop")
    t.add_argument("--loss-log", default="", help="write every step's training loss (the global mean under torchrun), "
                   "the gradient norm before clipping and each MoE layer's max/mean expert load over the step's "
                   "pairs (all ranks', after token rounding; with rounding, also the pairs each layer computed per "
                   "top-k pair; under --on-overflow drop, the rows dropped), then every validation loss, to this file "
                   "as JSON lines at the end of the run")
    c = p.add_argument_group("checkpoint")
    c.add_argument("--save", default=None, help="checkpoint path ('' to disable; default checkpoints/moeblaze.pt, "
                   "or the folder checkpoints/moeblaze-sharded under torchrun); a run never replaces one that is "
                   "there unless --resume or --overwrite says so")
    c.add_argument("--save-every", type=int, default=250, help="write the checkpoint every N steps (and at the end)")
    c.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint at --save (without one, say so and start from step 0)")
    c.add_argument("--overwrite", action="store_true",
                   help="start a new run where --save holds a checkpoint already, replacing it at the first save")
    _add_parallel_arguments(p)
    _add_bench_arguments(p)


def _add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """Expert parallelism and FSDP2 under torchrun."""
    g = p.add_argument_group("several processes (torchrun --nproc-per-node N)")
    g.add_argument("--ep", type=int, default=None,
                   help="expert-parallel ranks (a divisor of N and of --num-experts; 1: FSDP2 alone; default: by "
                        "rule, FSDP2 alone where the experts' gathered weights fit, ep = N where they don't)")
    g.add_argument("--ep-dispatch", default="exact", choices=DISPATCHES,
                   help="exact: variable all-to-all splits, one host sync per layer; capacity: fixed splits, none")
    g.add_argument("--ep-transport", default="tokens",
                   help="how rows cross: tokens (one row per (token, rank), equal to one GPU within the op's "
                        "rounding; default) or pairs (one row per (token, expert) pair, bitwise equal to one GPU)")
    g.add_argument("--ep-wire", default="native", choices=WIRES,
                   help="tokens: e4m3 sends x's and dy's rows as e4m3 with their scales, about half a bf16 row's bytes "
                        "(dW1 and dW2 then take the quantized rows); native: in the model's dtype (default)")
    g.add_argument("--ep-chunks", type=int, default=1,
                   help="the all-to-alls in this many parts, each part's under another part's GEMMs (tokens: each "
                        "rank's rows split; pairs, exact dispatch: the local experts grouped; default 1: no overlap)")
    g.add_argument("--capacity-factor", type=float, default=None,
                   help="capacity dispatch: rows per pair of ranks = factor x tokens x top-k / ep (default 1.25)")
    g.add_argument("--on-overflow", default="rerun", choices=ON_OVERFLOW,
                   help="capacity dispatch, when a rank needs more rows than the capacity: rerun the step with a "
                        "larger capacity (default), drop the rows past it (counted: the run says how many, "
                        "--loss-log per step), or stop with an error")
    g.add_argument("--fsdp-keep-gathered", nargs="?", const="yes", default="auto", choices=("auto", "yes", "no"),
                   help="keep each FSDP2 unit's gathered parameters from forward to backward (one all-gather per "
                        "step instead of two; the memory of the full parameters); default auto: yes where they "
                        "take at most an eighth of the GPU's memory")
    g.add_argument("--fsdp-reduce-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="the dtype of FSDP2's gradient reductions (default auto: bfloat16 under --dtype bfloat16, "
                        "as Megatron reduces, halving the reduce-scatter's bytes; float32 otherwise)")
    g.add_argument("--fsdp-units", default="blocks", choices=UNITS,
                   help="FSDP2 units: one per block and experts module (blocks), or the whole model as one "
                        "(model: one all-gather and reduce-scatter per step, for small models whose host time per "
                        "unit limits them; the experts stay their own units at --ep > 1)")


def _add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """--bench-steps: time steps and write a results row instead of training."""
    b = p.add_argument_group("benchmark")
    b.add_argument("--bench-steps", type=int, default=0,
                   help="time this many steps (after --bench-warmup) and write a results row, instead of training")
    b.add_argument("--bench-warmup", type=int, default=3, help="untimed steps before the timed ones")
    b.add_argument("--bench-profile", action="store_true", help="and one more step under torch.profiler: the step "
                   "split into GEMMs, all-to-all, all-gather + reduce-scatter and exposed communication")
    b.add_argument("--bench-trace", metavar="FILE", help="with --bench-profile: keep that step's chrome trace in "
                   "FILE (under torchrun, FILE.rank<i> for rank i > 0)")
    b.add_argument("--results", default="bench-results", help="folder of the results file (one JSON line "
                   "per run in <gpu>.jsonl)")


def check_flags(args) -> TrainConfig:
    """The run the flags say, after every check that reads only the flags (UsageError naming the flag or the
    config's field otherwise); the flags left unset take --preset's values. Torch-free. The command line's only
    reader: what follows takes the config."""
    preset = PRESETS[args.preset]
    for name in SHAPE:
        if getattr(args, name, None) is None:
            setattr(args, name, preset[name])
    for name in EXTRAS:  # None: the preset's, or the model's default
        if getattr(args, name, None) is None and name in preset:
            setattr(args, name, preset[name])
    try:
        _check_counts(args)
        _check_numbers(args)
        _check_combinations(args)
        return train_config(args)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None


def train_config(args) -> TrainConfig:
    """The flags as a TrainConfig (ValueError or TypeError naming the flag or field)."""
    return TrainConfig(
        preset=args.preset, model=model_config(args),
        schedule=Schedule(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                          aux_loss_coef=args.aux_loss_coef, z_loss_coef=args.z_loss_coef,
                          eval_every=args.eval_every, eval_batches=args.eval_batches, seed=args.seed),
        machine=Machine(device=args.device, dtype=args.dtype, threads=args.threads, compile=args.compile,
                        cuda_graph=args.cuda_graph),
        parallel=Parallel(ep=args.ep, ep_config=ep_config(args), on_overflow=args.on_overflow,
                          keep_gathered=args.fsdp_keep_gathered, reduce_dtype=args.fsdp_reduce_dtype,
                          units=args.fsdp_units),
        outputs=Outputs(save=args.save, save_every=args.save_every, resume=args.resume, overwrite=args.overwrite,
                        loss_log=args.loss_log),
        bench=Bench(steps=args.bench_steps, warmup=args.bench_warmup, profile=args.bench_profile,
                    trace=args.bench_trace, results=args.results))


def model_config(args) -> ModelConfig:
    """The flags' model: its shape, the experts' recipe, the router, the shared experts, token rounding."""
    return ModelConfig(max_seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                       num_experts=args.num_experts, top_k=args.top_k, d_expert=args.d_expert,
                       experts=experts_config(args), router=RouterConfig.family(args.router or "default"),
                       shared=flat_shared(args.shared_experts, args.d_shared, args.shared_gate),
                       rounding=flat_rounding(args.token_rounding, args.rounding_tile),
                       dense_layers=args.dense_layers or 0)


def ep_config(args) -> EPConfig:
    """The flags' expert-parallel transport, used where ep > 1 (the layout's rule may choose ep = N under
    --ep unset); refused where --ep 1 is given with a transport flag. --on-overflow rerun is the command's own (a
    CapacityTracker and a rerun of the step): EPConfig's overflow unset then."""
    if args.on_overflow != "rerun" and args.ep_dispatch != "capacity":
        raise ValueError(f"--on-overflow {args.on_overflow} applies to --ep-dispatch capacity, which this run does not "
                         "use")
    config = EPConfig(args.ep_dispatch, args.capacity_factor,
                      on_overflow=None if args.on_overflow == "rerun" else args.on_overflow, chunks=args.ep_chunks,
                      transport=args.ep_transport, wire=args.ep_wire)
    if (args.ep or 1) == 1:
        given = [flag for flag, set_ in ((f"--ep-dispatch {args.ep_dispatch}", args.ep_dispatch != "exact"),
                                         (f"--ep-chunks {args.ep_chunks}", args.ep_chunks != 1),
                                         (f"--ep-transport {args.ep_transport}", args.ep_transport != "tokens"),
                                         (f"--ep-wire {args.ep_wire}", args.ep_wire != "native"))
                 if set_]
        if given:
            raise ValueError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --ep > 1"
                             + ("" if args.ep else " (give --ep: the layout's rule chooses FSDP2 alone or ep = N)"))
    return config


def _check_counts(args) -> None:
    """The integer flags: positive counts, the seed, the threads (at most the cores), the optional counts."""
    for name in ("steps", "batch_size", "seq_len", "d_model", "n_layers", "n_heads", "num_experts", "top_k",
                 "d_expert", "eval_every", "eval_batches", "save_every", "bench_warmup"):
        check_int("--" + name.replace("_", "-"), getattr(args, name))
    if args.ep is not None:  # None: chosen by rule once the processes are known (parallel.choose_layout)
        check_int("--ep", args.ep)
    check_int("--seed", args.seed, minimum=0)
    check_int("--bench-steps", args.bench_steps, minimum=0)
    if args.threads is not None:
        check_int("--threads", args.threads)
        cores = os.cpu_count() or 1
        if args.threads > cores:
            raise ValueError(f"--threads must be at most this machine's {cores} cores, got {args.threads}")
    for name in ("shared_experts", "d_shared", "dense_layers", "rounding_tile"):
        if getattr(args, name) is not None:  # None: the preset's, or the model's default
            check_int("--" + name.replace("_", "-"), getattr(args, name), minimum=0)


def _check_numbers(args) -> None:
    """The real-valued flags: the learning rate, the losses' weights."""
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a positive finite number, got {args.lr}")
    for name in ("aux_loss_coef", "z_loss_coef"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v}")


def _check_combinations(args) -> None:
    """Flags that need others, or that another makes unread (refused, not ignored)."""
    if args.token_rounding and (args.ep or 1) > 1:
        raise ValueError("--token-rounding under --ep is not supported yet")
    if args.bench_trace and not (args.bench_steps and args.bench_profile):
        raise ValueError("--bench-trace keeps --bench-profile's trace: add --bench-steps N --bench-profile")
    check_choice("--on-overflow", args.on_overflow, ON_OVERFLOW)
    check_choice("--fsdp-units", args.fsdp_units, UNITS)
    if args.resume and args.save == "":
        raise ValueError("--resume needs a checkpoint path (--save)")
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the checkpoint at --save, --overwrite replaces it: choose one")
    if args.bench_steps and args.resume:
        raise ValueError("--bench-steps times fresh steps: it does not --resume")
