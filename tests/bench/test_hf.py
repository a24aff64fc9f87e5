"""The end-to-end benchmark's plumbing (moeblaze.bench.hf) on a tiny Qwen3-MoE on the CPU: every backend trains
the same model on the same batches (equal losses within bf16 noise), the experts' share and the largest batch are
measured, and the table renders. The published configs build (on the meta device: no memory)."""
import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
from moeblaze.bench import hf  # noqa: E402


def tiny(name, layers=None):
    return transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                       num_experts=6, num_experts_per_tok=2, num_hidden_layers=layers or 2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       max_position_embeddings=64)


def test_backends_train_alike_and_the_table_renders(monkeypatch):
    monkeypatch.setattr(hf, "model_config", tiny)
    backends = ["eager", "grouped_mm", "moeblaze-preact", "moeblaze-recompute"]
    reported = []
    rows = hf.run_model("qwen3-30b-a3b", backends, 2, 2, 16, 1, 3, find_max=True, max_limit=4,
                        device=torch.device("cpu"), report=reported.append)
    assert [r["backend"] for r in rows] == ["skip"] + backends and reported == rows  # each row reported as measured
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and len(r["losses"]) == 3 for r in rows)
    losses = [r["losses"] for r in rows[1:]]
    # the same seed and batches: the same loss curve within bf16 noise, under two bf16 ulps (2^-5) of a loss near
    # ln 64, whose logits each backend sums in another order
    for other in losses[1:]:
        assert max(abs(a - b) for a, b in zip(other, losses[0])) < 0.05
    assert all(0 <= r["experts_share"] < 1 for r in rows[1:])
    assert all(r["max_batch"] == 4 for r in rows[1:])  # no limit on the CPU but the one given
    table = hf.markdown(rows)
    assert table.count("\n") == 1 + len(backends) and "1.00x" in table


def test_a_failing_backend_is_its_rows_status(monkeypatch):
    monkeypatch.setattr(hf, "model_config", tiny)
    rows = hf.run_model("qwen3-30b-a3b", ["no_such_backend", "eager"], 2, 1, 8, 0, 1, find_max=False, max_limit=0,
                        device=torch.device("cpu"))
    assert rows[1]["status"].startswith("error:") and rows[2]["status"] == "ok"
    assert "error:" in hf.markdown(rows)


@pytest.mark.parametrize("name", list(hf.LAYERS))
def test_published_configs_build(name):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf.model_config(name), dtype=torch.bfloat16)
    assert model.config.num_hidden_layers == hf.LAYERS[name]


def test_the_sonicmoe_adapter_refuses_what_it_would_compute_differently():
    cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_local_experts=4,
                                    num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, layer_types=["full_attention"])
    experts = transformers.AutoModelForCausalLM.from_config(cfg).model.layers[0].mlp.experts
    with pytest.raises(NotImplementedError, match="SwiGLU experts in the default layout only"):
        hf._sonicmoe_experts(experts, torch.randn(3, 32), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
