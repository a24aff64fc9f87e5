"""Megatron-Core's MoE layer with its own experts and with moeblaze's, side by side in one process on one GPU:
forward + backward time and peak memory of one MoE layer of Qwen3-30B-A3B's shape, then of a few-layer GPTModel.

    python benchmarks/megatron_bench.py [--tokens 8192] [--layers 4] [--dense-first 0] [--ep 1]
                                        [--attention flash] [--out DIR]

Variants (one Megatron spec each, the same weights and tokens, bf16 parameters as Megatron's Float16Module keeps
them, under Megatron's DistributedDataParallel with fp32 gradient buffers, NCCL world of one):
  megatron-sequential   Megatron's local spec: SequentialMLP (a loop over the experts) after its all-to-all
                        dispatcher's permute
  megatron-grouped-mm   Megatron's own grouped-GEMM experts (GroupedMLP: the experts' weights as one stack, one
                        grouped GEMM per projection) on torch._grouped_mm in place of the grouped_gemm package,
                        which is a CUDA extension to build: what TEGroupedMLP computes, without TransformerEngine
  megatron-te-grouped   the TransformerEngine spec's TEGroupedMLP, where transformer_engine imports
  moeblaze              get_moeblaze_gpt_layer_spec: moeblaze's fused layer (checkpoint "preact")
  moeblaze-recompute    the same, ExpertsConfig(checkpoint="recompute")
  moeblaze-capacity     the same, under --ep its capacity dispatch (EPConfig("capacity", on_overflow="drop"): no
                        host sync; at top-8 on 2 ranks a token's rows fit the capacity, so nothing drops)
  moeblaze-stacked      moeblaze with the experts' parameters laid out last first in one buffer (as Megatron's
                        distributed optimizer lays them), where the layer stacks them per call instead of reading
                        them in place: what reading them in place saves
  moeblaze-in-megatron  dispatch="megatron": Megatron's dispatcher, moeblaze's op on its permuted rows
The model's attention (the same in every variant): --attention flash (default) runs each layer's core attention as
torch's scaled_dot_product_attention (a fused flash kernel, causal, grouped queries: the kind of kernel Megatron's
users train with, TransformerEngine's fused attention, which does not install here); --attention local keeps the
local spec's DotProductAttention, which forms each head's 4096 x 4096 scores (the rows before 2026-11-30).
step_ms: the median of --iters steps after --warmup (CUDA events around each); peak_mb: the allocator's peak over
the timed steps, weights and their gradients included. --ep N runs each variant on N GPUs (torchrun, Megatron's
expert parallelism over them, each GPU its own --tokens, the step ending in DDP's gradient sync): step_ms and
peak_mb are the largest over the ranks, tokens_per_s_per_gpu = --tokens / step. Each variant runs in a process
(or torchrun) of its own (Megatron's DDP keeps a stock layer alive in its process after the last reference to it
goes, which would count in the next variant's peak). One JSON row per variant (moeblaze bench's fields) to stdout
and DIR/<gpu>.jsonl; a variant that fails records its error instead.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeblaze import EPConfig, ExpertsConfig

QWEN3_30B = dict(hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128,
                 ffn_hidden_size=6144, num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768)
ATTENTION = ("flash", "local")
VARIANTS = ("megatron-sequential", "megatron-grouped-mm", "megatron-te-grouped", "moeblaze", "moeblaze-recompute",
            "moeblaze-capacity", "moeblaze-stacked", "moeblaze-in-megatron")


def grouped_gemm_on_torch() -> None:
    """Megatron's grouped_gemm hook (megatron.core.transformer.moe.grouped_gemm_util: `gg.ops.gmm`, which
    GroupedMLP calls) served by torch._grouped_mm, for this process: gmm(a (rows, k), b (E, k, n) or (E, n, k) with
    trans_b, batch_sizes (E,)) -> (rows, n), the rows of expert e being the e-th run of batch_sizes[e] rows."""
    try:
        from megatron.core.transformer.moe import grouped_gemm_util as gg
        from megatron.core.transformer.moe.experts import GroupedMLP  # noqa: F401  (gone in 0.17: TE's only)
    except ImportError as e:
        raise RuntimeError("megatron-grouped-mm runs Megatron's GroupedMLP, which megatron-core 0.17 removed (its "
                           "grouped experts are TransformerEngine's since): run it on megatron-core 0.16") from e

    class Ops:
        @staticmethod
        def gmm(a, b, batch_sizes, trans_b=False):
            offs = torch.cumsum(batch_sizes.to(a.device), 0, dtype=torch.int32)
            return torch._grouped_mm(a, b.transpose(1, 2) if trans_b else b, offs=offs)

    gg.grouped_gemm, gg.ops = "torch._grouped_mm", Ops


def transformer_config(layers: int, te: bool, grouped: bool = False, dense_first: int = 0):
    """dense_first: the model's first layers dense (DeepSeek-V3's layout), the rest MoE."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    freq = [0] * dense_first + [1] * (layers - dense_first) if dense_first else 1
    return TransformerConfig(num_layers=layers, **QWEN3_30B, moe_layer_freq=freq, gated_linear_unit=True,
                             activation_func=F.silu,
                             add_bias_linear=False, normalization="RMSNorm", qk_layernorm=True,
                             moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
                             moe_aux_loss_coeff=1e-3, moe_grouped_gemm=te or grouped, bf16=True,
                             params_dtype=torch.bfloat16,
                             bias_activation_fusion=te, apply_rope_fusion=False, masked_softmax_fusion=False,
                             gradient_accumulation_fusion=False, persist_layer_norm=False)


def spec(variant: str):
    from megatron.core.models.gpt import gpt_layer_specs

    from moeblaze.integrations.megatron import get_moeblaze_gpt_layer_spec
    E = QWEN3_30B["num_moe_experts"]
    if variant in ("megatron-sequential", "megatron-grouped-mm"):
        grouped = variant == "megatron-grouped-mm"
        if grouped:
            grouped_gemm_on_torch()
        return gpt_layer_specs.get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=grouped, qk_layernorm=True)
    if variant == "megatron-te-grouped":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=E, moe_grouped_gemm=True,
                                                                          qk_layernorm=True)
    return get_moeblaze_gpt_layer_spec(E, qk_layernorm=True, **_recipe(variant))


def _recipe(variant: str) -> dict:
    """A moeblaze variant's recipe, dispatch and expert-parallel config, as both spec helpers take them."""
    return dict(experts=ExpertsConfig(checkpoint="recompute" if variant == "moeblaze-recompute" else "preact"),
                dispatch="megatron" if variant == "moeblaze-in-megatron" else "moeblaze",
                ep=EPConfig("capacity", on_overflow="drop") if variant == "moeblaze-capacity" else None)


def block_spec(variant: str, cfg):
    """The variant's decoder block spec (dense and MoE layers as cfg.moe_layer_freq lays them out)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from moeblaze.integrations.megatron import get_moeblaze_gpt_decoder_block_spec
    if variant.startswith("megatron-"):
        if variant == "megatron-grouped-mm":
            grouped_gemm_on_torch()
        return gpt_layer_specs.get_gpt_decoder_block_spec(cfg, use_transformer_engine=variant == "megatron-te-grouped")
    return get_moeblaze_gpt_decoder_block_spec(cfg, **_recipe(variant))


@functools.cache
def flash_attention():
    """Megatron's DotProductAttention with its forward on torch's scaled_dot_product_attention (its constructor,
    parameters, dropout and checkpoint layout unchanged): causal self-attention, key/value groups shared by the
    queries."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class FlashAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            kind = attn_mask_type or self.attn_mask_type
            if (kind != AttnMaskType.causal or attention_mask is not None or attention_bias is not None
                    or packed_seq_params is not None):
                raise ValueError("the benchmark's flash attention runs causal self-attention without a mask, bias "
                                 "or packed sequences")
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 dropout_p=self.attention_dropout.p if self.training else 0.0,
                                                 enable_gqa=q.shape[1] != k.shape[1])
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
    return FlashAttention


def with_attention(s, attention: str):
    """The layer or block spec s with each layer's core attention as --attention names it."""
    if attention == "local":
        return s
    for layer in getattr(s, "layer_specs", None) or [s]:
        layer.submodules.self_attention.submodules.core_attention = flash_attention()
    return s


def build(what: str, variant: str, layers: int, dense_first: int, attention: str):
    """The variant's layer or model under Megatron's DistributedDataParallel (world of one), as Megatron trains:
    gradients into its fp32 buffer, the parameters laid out in its buffer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    cfg = transformer_config(layers, te=variant == "megatron-te-grouped", grouped=variant == "megatron-grouped-mm",
                             dense_first=dense_first if what == "model" else 0)
    s = with_attention(block_spec(variant, cfg) if what == "model" and dense_first else spec(variant), attention)
    torch.manual_seed(0)
    if what == "layer":
        mlp = s.submodules.mlp
        model = (build_module(mlp, config=cfg) if isinstance(mlp, ModuleSpec) else mlp(config=cfg)).cuda()
    else:
        from megatron.core.models.gpt import GPTModel
        model = GPTModel(config=cfg, transformer_layer_spec=s, vocab_size=32768, max_sequence_length=4096,
                         position_embedding_type="rope").cuda()
    if variant == "moeblaze-stacked":
        lay_out_last_first(model)
    return DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)


def lay_out_last_first(model) -> None:
    """Each moeblaze experts module's parameters moved into one buffer, last first (values unchanged)."""
    from moeblaze.integrations.megatron import MoeblazeSequentialMLP
    for module in model.modules():
        if isinstance(module, MoeblazeSequentialMLP):
            params = list(module.parameters())[::-1]
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            at = 0
            for p in params:
                p.data = flat[at:at + p.numel()].view_as(p)
                at += p.numel()


def wall_and_issue(step, warmup: int, iters: int, warm=None) -> tuple[float, float]:
    """(wall ms, the host's ms to issue it) a step over `iters` steps, each synchronized, after `warmup` steps and
    then warm() (where given): where the two near each other, the host paces the step."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    if warm is not None:
        warm()
    issue, start = 0.0, time.perf_counter()
    for _ in range(iters):
        at = time.perf_counter()
        step()
        issue += time.perf_counter() - at
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3, issue / iters * 1e3


def step_args(ap) -> None:
    """The flags make_step reads beside --what: the tokens, the model's layers and attention."""
    ap.add_argument("--tokens", type=int, default=8192, help="tokens a step (sequences of 4096)")
    ap.add_argument("--layers", type=int, default=4, help="the GPTModel's layers")
    ap.add_argument("--dense-first", type=int, default=0,
                    help="the GPTModel's first layers dense (DeepSeek-V3's layout; the decoder block spec)")
    ap.add_argument("--attention", choices=ATTENTION, default="flash",
                    help="the model's core attention in every variant (the module header)")


def timed(step, warmup: int, iters: int) -> tuple[float, float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**20


def make_step(what: str, variant: str, args):
    """One training step of the variant's layer or model (forward, backward, and under --ep the gradient sync)."""
    model = build(what, variant, args.layers, args.dense_first, args.attention)
    seq, batch = 4096, args.tokens // 4096
    seed = 1 + dist.get_rank()  # each rank its own tokens
    if what == "layer":
        fwd_bwd = layer_step(model, args.tokens, seed)
    else:
        g = torch.Generator(device="cuda").manual_seed(seed)
        ids = torch.randint(0, 32768, (batch, seq), device="cuda", generator=g)
        pos = torch.arange(seq, device="cuda")[None].expand(batch, -1)

        def fwd_bwd():
            logits = model(ids, pos, attention_mask=None)
            logits.float().square().mean().backward()
    if dist.get_world_size() == 1:
        return fwd_bwd

    def step():  # the gradients of what every rank holds reduced, as a training step must
        fwd_bwd()
        model.finish_grad_sync()
    return step


def run(what: str, variant: str, args) -> dict:
    ms, peak = timed(make_step(what, variant, args), args.warmup, args.iters)
    worst = torch.tensor([ms, peak], device="cuda", dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ms, peak = worst.tolist()
    return {"step_ms": round(ms, 3), "peak_mb": round(peak, 1),
            "tokens_per_s_per_gpu": round(args.tokens / ms * 1e3)}


def megatron_world(port: str = "29517") -> None:
    """An NCCL world (torchrun's, else one process on GPU 0) and Megatron's parallel state over it: tensor and
    pipeline parallel sizes 1, expert parallelism over the whole world, seeded."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", port)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", rank=int(os.environ.get("RANK", 0)),
                            world_size=int(os.environ.get("WORLD_SIZE", 1)))
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16 reads it undefined where TE does not import
        moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=dist.get_world_size())
    model_parallel_cuda_manual_seed(0)


def layer_step(model, tokens: int, seed: int = 1):
    """One forward + backward of a layer on fixed random tokens (sequences of 4096) and output gradients."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(4096, tokens // 4096, QWEN3_30B["hidden_size"], device="cuda", dtype=torch.bfloat16,
                    generator=g, requires_grad=True)
    dout = torch.randn_like(x)

    def step():
        out, _ = model(x)
        out.backward(dout)
    return step


def child(args) -> None:
    """One variant of one benchmark in this process (--child; on each rank under --ep): its row on stdout."""
    megatron_world()
    try:
        row = run(args.what, args.variants, args)
    except Exception as e:  # noqa: BLE001 - the row records why the variant did not run
        print("ROW " + json.dumps({"error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
        if dist.get_world_size() > 1:
            raise  # this rank's exit ends the others (torchrun), which may wait on it in a collective
        row = None
    if row is not None and dist.get_rank() == 0:
        print("ROW " + json.dumps(row), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    step_args(ap)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--what", default="layer,model", help="layer, model or both")
    ap.add_argument("--ep", type=int, default=1, help="GPUs, Megatron's expert parallelism over them (torchrun)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from importlib.metadata import version

    from moeblaze.cli.bench import run_env
    env = run_env(torch.device("cuda"), "python benchmarks/megatron_bench.py " + " ".join(sys.argv[1:]))
    env["megatron_core"] = version("megatron-core")
    path = os.path.join(args.out, env["gpu"].lower().replace(" ", "-") + ".jsonl")
    os.makedirs(args.out, exist_ok=True)
    q = QWEN3_30B
    for what in args.what.split(","):
        for variant in args.variants.split(","):
            row = {"impl": f"megatron:{variant}", "bench": f"megatron-{what}", "L": args.tokens, "d": q["hidden_size"],
                   "h": q["moe_ffn_hidden_size"], "E": q["num_moe_experts"], "K": q["moe_router_topk"],
                   "layers": 1 if what == "layer" else args.layers,
                   "dense_first": args.dense_first if what == "model" else 0,
                   "attention": args.attention if what == "model" else None, "ep": args.ep, "gpus": args.ep,
                   **env}
            # a process per variant: Megatron's DDP keeps a stock layer alive after its last reference goes (a CPU
            # check showed it), which would count in the next variant's peak
            launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone",
                                          f"--nproc-per-node={args.ep}"] if args.ep > 1 else [])
            r = subprocess.run(launch + [__file__, "--child", "--what", what, "--variants", variant,
                                "--tokens", str(args.tokens), "--layers", str(args.layers), "--dense-first",
                                str(args.dense_first), "--attention", args.attention, "--ep", str(args.ep), "--warmup",
                                str(args.warmup), "--iters", str(args.iters)], capture_output=True, text=True)
            rows = [line[4:] for line in r.stdout.splitlines() if line.startswith("ROW ")]
            row.update(json.loads(rows[-1]) if rows else {"error": f"exit {r.returncode}: {r.stderr[-300:]}"})
            print(json.dumps(row), flush=True)
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
