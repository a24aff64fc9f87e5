"""On a CUDA GPU (`pytest -m gpu`): transformers models at their real widths (hidden size, expert width, top-k;
fewer layers, a small vocabulary, and fewer experts where the real count would not fit), in bf16 on the moeblaze
experts backend, against the same model in fp32 on transformers' eager experts: logits and every parameter's
gradient within FACTOR times the error of transformers' own bf16 eager experts (plus a floor for gradients that are
zero in all three). One MoE layer (after any dense one), so that the bf16 runs route every token alike."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
import moeblaze.integrations.transformers as mbt  # noqa: E402
from moeblaze import ExpertsConfig  # noqa: E402
from moeblaze.experts import launch_counts  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FACTOR = 2.0
FLOOR = 1e-4


def real_width_configs():
    T = transformers
    small = dict(vocab_size=1024, max_position_embeddings=512)
    return {
        # Qwen3-30B-A3B
        "qwen3_moe": T.Qwen3MoeConfig(**small, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                      num_experts=128, num_experts_per_tok=8, num_hidden_layers=1,
                                      num_attention_heads=32, num_key_value_heads=4, head_dim=128),
        # Mixtral-8x7B
        "mixtral": T.MixtralConfig(**small, hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                   num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=32,
                                   num_key_value_heads=8),
        # OLMoE-1B-7B
        "olmoe": T.OlmoeConfig(**small, hidden_size=2048, intermediate_size=1024, num_experts=64,
                               num_experts_per_tok=8, num_hidden_layers=1, num_attention_heads=16,
                               num_key_value_heads=16),
        # DeepSeek-V3's widths with 32 routed experts (256 would take 11 G parameters a layer): a dense layer, then MoE
        "deepseek_v3": T.DeepseekV3Config(**small, hidden_size=7168, intermediate_size=18432,
                                          moe_intermediate_size=2048, n_routed_experts=32, num_experts_per_tok=8,
                                          n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=1,
                                          num_hidden_layers=2, num_attention_heads=128, num_key_value_heads=128,
                                          q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                                          qk_nope_head_dim=128, v_head_dim=128),
        # Qwen3-Next-80B-A3B, its full-attention layer
        "qwen3_next": T.Qwen3NextConfig(**small, hidden_size=2048, intermediate_size=5120, moe_intermediate_size=512,
                                        shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
                                        num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=2,
                                        head_dim=256, layer_types=["full_attention"]),
        # gpt-oss-20b
        "gpt_oss": T.GptOssConfig(**small, hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                                  num_experts_per_tok=4, num_hidden_layers=1, num_attention_heads=64,
                                  num_key_value_heads=8, head_dim=64, layer_types=["full_attention"]),
    }


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _step(model, implementation, ids):
    model.set_experts_implementation(implementation)
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _kernels_within_bound(ref_model, implementation: str, kernels: ExpertsConfig, ids) -> None:
    """ref_model (fp32) on `implementation` is the reference; its bf16 copy on `implementation` sets the bound
    (FACTOR times that copy's error, plus FLOOR); the same bf16 copy on moeblaze's kernels with the recipe `kernels`:
    logits and every gradient within the bound."""
    ref_logits, ref_grads = _step(ref_model, implementation, ids)
    model = copy.deepcopy(ref_model).to(torch.bfloat16)
    ref_model.zero_grad(set_to_none=True)
    base_logits, base_grads = _step(model, implementation, ids)
    bound = {n: FACTOR * _rel(g, ref_grads[n]) + FLOOR for n, g in base_grads.items()}
    bound["logits"] = FACTOR * _rel(base_logits, ref_logits) + FLOOR
    del base_grads
    mbt.configure(model, kernels)
    launch_counts.clear()
    logits, grads = _step(model, "moeblaze", ids)
    assert launch_counts, "the moeblaze kernels never ran"
    assert grads.keys() == ref_grads.keys()
    errs = {n: _rel(g, ref_grads[n]) for n, g in grads.items()}
    errs["logits"] = _rel(logits, ref_logits)
    assert all(torch.isfinite(g).all() for g in grads.values())
    bad = {n: (errs[n], bound[n]) for n in errs if not errs[n] <= bound[n]}
    assert not bad, bad


def _real_width_model(name: str):
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(real_width_configs()[name], experts_implementation="eager")


@pytest.mark.parametrize("checkpoint", ["preact", "recompute"])
@pytest.mark.parametrize("name", list(real_width_configs()))
def test_real_widths_bf16_against_fp32_eager(name, checkpoint):
    ref_model = _real_width_model(name)
    ids = torch.randint(0, 1024, (2, 128), device="cuda")
    _kernels_within_bound(ref_model, "eager", ExpertsConfig(checkpoint=checkpoint, backend="triton"), ids)
    del ref_model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("checkpoint", ["preact", "recompute"])
def test_gpt_oss_fp8_at_real_widths_against_the_emulation(checkpoint):
    """gpt-oss-20b's widths with precision="fp8" in bf16 on the kernels, against the reference's emulation of the
    same recipe in fp32: logits and every gradient within FACTOR times the bf16 emulation's own error."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89+")
    ref_model = _real_width_model("gpt_oss")
    ids = torch.randint(0, 1024, (2, 128), device="cuda")
    fp8 = ExpertsConfig(precision="fp8", fp8_min_rows=0, checkpoint=checkpoint)
    mbt.configure(ref_model, fp8.replace(backend="reference"))
    _kernels_within_bound(ref_model, "moeblaze", fp8.replace(backend="triton"), ids)
