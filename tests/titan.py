"""torchtitan's MoE models for the tests: its debug models built from its configs (random init, no download),
cut to 2 layers, attention on SDPA where FlexAttention can't run (its CPU backward), and torchtitan's own
experts computed in fp32 (its grouped_mm casts to bf16) as the reference. Also the GPU benchmark's
(benchmarks/torchtitan_train.py) way to build them.

torchtitan 0.3.0 imports two names that torch 2.11's FSDP lacks (torch.distributed.fsdp.DataParallelMeshDims,
torch.distributed.fsdp._fully_shard._fsdp_common.ShardPlacementResult), used only by its FSDP wrapping, which
nothing here runs: where torch lacks them they are stubbed before torchtitan's models are imported (STUBBED
names them); so is torchtitan.trainer's Trainer where HuggingFace datasets is missing (update_from_config imports
it for an isinstance check only)."""
import dataclasses
import importlib
import types

import torch


def _stub_missing_fsdp_names() -> list[str]:
    stubbed = []
    for module, name in (("torch.distributed.fsdp", "DataParallelMeshDims"),
                         ("torch.distributed.fsdp._fully_shard._fsdp_common", "ShardPlacementResult")):
        m = importlib.import_module(module)
        if not hasattr(m, name):
            setattr(m, name, type(name, (), {}))
            stubbed.append(f"{module}.{name}")
    return stubbed


def _stub_trainer_without_datasets() -> list[str]:
    """torchtitan.trainer, which the model configs' update_from_config imports only for an isinstance check,
    imports HuggingFace `datasets`; where that is missing (the GPU machine), a stand-in with that one name."""
    import importlib.util
    import sys

    if importlib.util.find_spec("datasets") is not None or "torchtitan.trainer" in sys.modules:
        return []
    stub = types.ModuleType("torchtitan.trainer")
    stub.Trainer = type("Trainer", (), {"Config": type("Config", (), {})})
    sys.modules["torchtitan.trainer"] = stub
    return ["torchtitan.trainer.Trainer (no datasets)"]


def _stub_non_strict_tracing() -> list[str]:
    """torchtitan 0.3's token dispatchers ask torch.compiler._is_non_strict_tracing() (torch >= 2.13); on an older
    torch nothing traces non-strict: False."""
    if hasattr(torch.compiler, "_is_non_strict_tracing"):
        return []
    torch.compiler._is_non_strict_tracing = lambda: False
    return ["torch.compiler._is_non_strict_tracing"]


STUBBED = _stub_missing_fsdp_names() + _stub_trainer_without_datasets() + _stub_non_strict_tracing()
from torchtitan.models import deepseek_v3, qwen3  # noqa: E402
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402


def sdpa(config):
    """Every FlexAttention of the config on torch's SDPA (causal)."""
    for _fqn, _c, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return config


def model_config(family: str, converters=(), narrow: bool = False):
    """torchtitan's debug model of the family, 2 layers (DeepSeek-V3: a dense one, then MoE); narrow: the same
    builder at widths the interpreter runs in seconds."""
    if family == "qwen3":
        if narrow:
            from torchtitan.models.qwen3 import _build_qwen3_moe_layers
            from torchtitan.models.common.rope import CosSinRoPE

            base = qwen3.model_registry("debugmodel_moe").model
            dim = 64
            config = dataclasses.replace(
                base, dim=dim, norm=dataclasses.replace(base.norm, normalized_shape=dim),
                tok_embeddings=dataclasses.replace(base.tok_embeddings, embedding_dim=dim),
                lm_head=dataclasses.replace(base.lm_head, in_features=dim),
                layers=_build_qwen3_moe_layers(fuse_qkv=True, n_layers=2, dim=dim, n_heads=4, n_kv_heads=2,
                                               head_dim=16, moe_hidden_dim=32, num_experts=8, top_k=2,
                                               attn_backend="flex", moe_comm_backend="standard",
                                               rope=CosSinRoPE.Config(dim=16, max_seq_len=256, theta=1e6)))
        else:
            config = qwen3.model_registry("debugmodel_moe").model
            config.layers = config.layers[:2]
    else:
        config = deepseek_v3.model_registry("debugmodel").model
        config.layers = config.layers[:2]
    config = sdpa(config)
    for c in converters:
        config = c.build().convert(config)
    return config


def parallel_build(config, parallelism, world: int, device: str):
    """(the model of config on the meta device, torchtitan's ParallelDims for parallelism over world ranks, its mesh
    built), set up as torchtitan's trainer does: its device type and SPMD backend, and the config updated with the
    parallelism first (update_from_config, which is what shards the experts under expert parallelism)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed.utils import set_spmd_backend

    parallel_dims.device_type = device
    set_spmd_backend(parallelism.spmd_backend)
    dims = parallel_dims.ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = config.build()
    return model, dims


def build(config, seed=0, device="cpu"):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model


def _fp32_grouped_experts(self, x_RD, counts_E):
    """GroupedExperts.forward in x's dtype (its own casts to bf16 taken out), expert by expert."""
    # unbind, not w[e]: one backward node stacks the experts' gradients (indexing would zero-fill a whole weight
    # gradient per expert)
    w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    w1, w2, w3 = w1.unbind(0), w2.unbind(0), w3.unbind(0)
    outs, start = [x_RD[:0]], 0
    for e, n in enumerate(counts_E.tolist()):
        x = x_RD[start:start + n]
        h = torch.nn.functional.silu(x @ w1[e].t()) * (x @ w3[e].t())
        outs.append(h @ w2[e].t())
        start += n
    return torch.cat(outs)


def fp32_default(model):
    for m in model.modules():
        if type(m) is GroupedExperts:
            m.forward = types.MethodType(_fp32_grouped_experts, m)
    return model
