"""moeblaze as transformers' experts backend, on tiny random-initialised models built from their config classes
(no download): logits and every parameter's gradient against transformers' eager experts in fp32, on the
reference path and on the Triton kernels under the interpreter; expert-parallel sentinels; each fallback
reason warns once and matches eager; torch.compile."""
import warnings

import pytest
import torch

import moeblaze.experts  # routed_call's moe_experts: what the integrations' calls reach

transformers = pytest.importorskip("transformers", minversion="5.0")
import moeblaze.integrations.transformers as mbt  # noqa: E402
from moeblaze import ExpertsConfig  # noqa: E402
from moeblaze.experts import launch_counts  # noqa: E402
from helpers import FP8_VS_EMULATION, rel_err  # noqa: E402

TOL = 1e-5  # fp32: only the summation order differs from eager
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


def configs():
    T = transformers
    return {
        "qwen3_moe": T.Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=16, num_experts=6,
                                      num_experts_per_tok=2, head_dim=8),
        "mixtral": T.MixtralConfig(**COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
        "olmoe": T.OlmoeConfig(**COMMON, intermediate_size=16, num_experts=6, num_experts_per_tok=2),
        "deepseek_v3": T.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=64,
                                          moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                                          n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                                          q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                          v_head_dim=8),
        "qwen3_next": T.Qwen3NextConfig(**COMMON, intermediate_size=64, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                                        head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
                                        linear_key_head_dim=8, linear_value_head_dim=8,
                                        layer_types=["linear_attention", "full_attention"]),
        "gpt_oss": transformers.GptOssConfig(**COMMON, intermediate_size=16, num_local_experts=4,
                                             num_experts_per_tok=2, head_dim=8,
                                             layer_types=["sliding_attention", "full_attention"]),
    }


def build(name, **over):
    torch.manual_seed(0)
    cfg = configs()[name]
    for k, v in over.items():
        setattr(cfg, k, v)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    if name == "gpt_oss":  # pre-activations past the clamp limits (±7), and biases that are not zero
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "gate_up_proj_bias"):
                    m.gate_up_proj.mul_(150)
                    m.gate_up_proj_bias.normal_(0, 2)
                    m.down_proj_bias.normal_(0, 0.5)
    return model


def step(model, implementation, ids):
    """(logits, {name: grad}) of one forward and backward on the given experts implementation."""
    model.set_experts_implementation(implementation)
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_matches_eager(model, ids):
    logits_e, grads_e = step(model, "eager", ids)
    logits_m, grads_m = step(model, "moeblaze", ids)
    assert rel_err(logits_m, logits_e) <= TOL
    assert grads_m.keys() == grads_e.keys()
    bad = {n: rel_err(grads_m[n], g) for n, g in grads_e.items() if not rel_err(grads_m[n], g) <= TOL}
    assert not bad, bad


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "qwen3_next", "gpt_oss"])
def test_models_match_eager_experts(monkeypatch, name, impl, poison_alloc):
    model = build(name)
    checkpoint = "recompute" if name in ("mixtral", "gpt_oss") else "preact"
    n = mbt.configure(model, ExpertsConfig(backend=impl, checkpoint=checkpoint))
    assert n == sum(1 for m in model.modules() if hasattr(m, "gate_up_proj")) > 0
    calls = []
    real = moeblaze.experts.moe_experts
    monkeypatch.setattr(moeblaze.experts, "moe_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    launch_counts.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback: every experts module ran on moeblaze
        assert_matches_eager(model, torch.randint(0, 64, (2, 12)))
    assert calls, "the moeblaze backend was never called"
    assert (impl == "triton") == bool(launch_counts)


@pytest.mark.parametrize("checkpoint", ["preact", "recompute"])
def test_gpt_oss_trains_in_fp8_matching_the_emulation(checkpoint, poison_alloc):
    """gpt-oss (biases, interleaved gate/up, transposed weights, the clamped SwiGLU) with precision="fp8" on the
    kernels (interpreter, fp32): logits and every gradient within 1e-3 of the reference's emulation of the same
    recipe (an element on an e4m3 rounding boundary may round the other way), and a few steps of SGD lower the
    loss."""
    model = build("gpt_oss", hidden_size=128)  # e4m3's 1 x 128 groups at a real group width
    ids = torch.randint(0, 64, (2, 12))
    fp8 = ExpertsConfig(precision="fp8", fp8_min_rows=0, checkpoint=checkpoint)
    mbt.configure(model, fp8.replace(backend="reference"))
    logits_e, grads_e = step(model, "moeblaze", ids)
    mbt.configure(model, fp8.replace(backend="triton"))
    launch_counts.clear()
    logits_m, grads_m = step(model, "moeblaze", ids)
    assert launch_counts, "the kernels never ran"
    assert rel_err(logits_m, logits_e) <= FP8_VS_EMULATION
    assert grads_m.keys() == grads_e.keys()
    bad = {n: rel_err(grads_m[n], g) for n, g in grads_e.items() if not rel_err(grads_m[n], g) <= FP8_VS_EMULATION}
    assert not bad, bad
    experts = model.model.layers[0].mlp.experts
    assert grads_m["model.layers.0.mlp.experts.gate_up_proj_bias"].abs().sum() > 0
    assert rel_err(grads_m["model.layers.0.mlp.experts.gate_up_proj"],
                   step(model, "eager", ids)[1]["model.layers.0.mlp.experts.gate_up_proj"]) > 1e-4  # e4m3 shows
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.set_experts_implementation("moeblaze")
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert experts.gate_up_proj.grad is not None


def test_weights_are_used_in_place_never_copied(monkeypatch):
    model = build("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    seen = []
    real = moeblaze.experts.moe_experts
    monkeypatch.setattr(moeblaze.experts, "moe_experts", lambda x, r, w, w1, w2, *a, **k: seen.append((w1, w2)) or
                        real(x, r, w, w1, w2, *a, **k))
    model.set_experts_implementation("moeblaze")
    model(torch.randint(0, 64, (1, 8)))
    assert seen[0][0] is experts.gate_up_proj and seen[0][1] is experts.down_proj


def test_gpt_oss_weights_are_read_through_views_and_reach_the_clamps(monkeypatch):
    """gpt-oss's transposed parameters and biases reach moe_experts as views (no copy), and its pre-activations
    in these tests pass the clamp limits, so the clamped branches are compared with eager."""
    model = build("gpt_oss")
    experts = model.model.layers[0].mlp.experts
    seen = []
    real = moeblaze.experts.moe_experts
    monkeypatch.setattr(moeblaze.experts, "moe_experts", lambda x, r, w, w1, w2, b1, b2, **k:
                        seen.append((x, w1, w2, b1, b2, k)) or real(x, r, w, w1, w2, b1, b2, **k))
    model.set_experts_implementation("moeblaze")
    model(torch.randint(0, 64, (2, 12)))
    x, w1, w2, b1, b2, k = seen[0]
    assert w1.untyped_storage().data_ptr() == experts.gate_up_proj.untyped_storage().data_ptr()
    assert w2.untyped_storage().data_ptr() == experts.down_proj.untyped_storage().data_ptr()
    assert b1 is experts.gate_up_proj_bias and b2 is experts.down_proj_bias and k["interleaved"]
    h = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (h[:, ::2] > 7).any() and (h[:, 1::2].abs() > 7).any()


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_expert_parallel_sentinels_are_skipped(impl, name, poison_alloc):
    """ids >= num_experts with zero weight (transformers' expert parallelism; a token may hold several): the
    same output and gradients as transformers' grouped_mm, which drops them (biases included)."""
    experts = build(name).model.layers[0].mlp.experts
    mbt.configure(experts, ExpertsConfig(backend=impl))
    E, T, K = experts.num_experts, 20, min(4, experts.num_experts)
    gen = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(E + 3, generator=gen)[:K] for _ in range(T)])
    idx = torch.where(idx >= E, torch.full_like(idx, E), idx)  # the sentinel is num_experts, repeated
    assert (idx == E).any() and ((idx == E).sum(1) > 1).any()
    w = torch.where(idx == E, 0.0, torch.rand(T, K, generator=gen))
    x = torch.randn(T, 32, generator=gen)
    results = []
    for fn in (transformers.integrations.moe.grouped_mm_experts_forward, mbt.experts_forward):
        experts.zero_grad()
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(experts, xi, idx, wi)
        y.square().sum().backward()
        results.append([y, xi.grad, wi.grad] + [p.grad.clone() for p in experts.parameters()])
    for a, b in zip(*results):
        assert torch.isfinite(b).all() and rel_err(b, a) <= TOL
    assert torch.equal(results[1][2][idx == E], torch.zeros(int((idx == E).sum())))


def _custom_gate(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate).clamp(max=0.5) * up


@pytest.mark.parametrize("case,reason", [
    ("gpt_oss_limit", "a clamped SwiGLU with limit=5.0"),
    ("interleaved_default_gate", "interleaved gate/up columns with the default gate"),
    ("tanh_gelu", "activation 'gelu_pytorch_tanh'"),
    ("custom_gate", "a custom _apply_gate"),
])
def test_what_moeblaze_cannot_compute_falls_back_with_one_warning(monkeypatch, case, reason):
    if case == "gpt_oss_limit":
        model = build("gpt_oss")
        for layer in model.model.layers:
            layer.mlp.experts.limit = 5.0
    elif case == "interleaved_default_gate":
        model = build("qwen3_moe")
        for layer in model.model.layers:
            layer.mlp.experts.is_concatenated = False
    elif case == "tanh_gelu":
        model = build("qwen3_moe", hidden_act="gelu_pytorch_tanh")
    else:
        model = build("qwen3_moe")
        monkeypatch.setattr(type(model.model.layers[0].mlp.experts), "_apply_gate", _custom_gate)
    monkeypatch.setattr(mbt, "_warned", set())
    monkeypatch.setattr(moeblaze.experts, "moe_experts", lambda *a, **k: pytest.fail("moeblaze computed what it can't"))
    ids = torch.randint(0, 64, (2, 12))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_matches_eager(model, ids)
        step(model, "moeblaze", ids)
    ours = [str(w.message) for w in caught if "moeblaze experts backend" in str(w.message)]
    assert len(ours) == 1 and reason in ours[0], ours


def test_settings_are_checked_and_reach_the_call(monkeypatch):
    model = build("olmoe")
    with pytest.raises(ValueError, match="checkpoint"):
        mbt.configure(model, ExpertsConfig(checkpoint="all"))
    with pytest.raises(ValueError, match="chunk_tokens"):
        mbt.configure(model, ExpertsConfig(chunk_tokens=0))
    with pytest.raises(TypeError, match="ExpertsConfig"):
        mbt.configure(model, {"checkpoint": "recompute"})
    mbt.configure(model, ExpertsConfig(checkpoint="recompute", chunk_tokens=5, backend="tl"))
    seen = []
    monkeypatch.setattr(moeblaze.experts, "moe_experts",
                        lambda *a, **k: seen.append(k["experts"]) or torch.zeros_like(a[0]))
    model.set_experts_implementation("moeblaze")
    model(torch.randint(0, 64, (1, 8)))
    assert seen and {(c.checkpoint, c.chunk_tokens, c.backend) for c in seen} == {("recompute", 5, "tl")}


def test_registration_paths():
    cfg = configs()["olmoe"]
    assert transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="moeblaze").config. \
        _experts_implementation == "moeblaze"
    mbt.register()  # idempotent
    assert "moeblaze" in transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS


def test_compiled_model_matches_eager():
    torch._dynamo.reset()
    model = build("qwen3_moe", num_hidden_layers=1)  # a second layer traces the same code again
    model.set_experts_implementation("moeblaze")
    for impl in ("reference", "triton"):
        # the sort builder: dynamo can't trace Triton's interpreter, which the dense builder runs on here
        mbt.configure(model, ExpertsConfig(backend=impl, index_method="sort"))
        ids = torch.randint(0, 64, (2, 12))
        eager = model(ids).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits  # no graph break
        assert rel_err(compiled, eager) <= TOL


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_negative_expert_id_is_refused_by_name(impl):
    """An id of -1 reached the kernels as an index error deep inside; transformers' eager experts refuse it too.
    Now a ValueError that names the ids' range (a device-side assert on a GPU)."""
    experts = build("qwen3_moe").model.layers[0].mlp.experts
    mbt.configure(experts, ExpertsConfig(backend=impl))
    idx = torch.tensor([[0, 1], [2, -1], [3, 4]])
    with pytest.raises(ValueError, match=r"expert id is negative: the ids must be in \[0, 6\)"):
        mbt.experts_forward(experts, torch.randn(3, 32), idx, torch.rand(3, 2))


def test_a_model_without_experts_built_for_moeblaze_warns():
    """Issue: from_config(a dense Llama, experts_implementation="moeblaze") built with nothing on moeblaze and no
    warning (transformers refuses "grouped_mm" there, but takes any registered name). Now one warning names the
    model; an MoE model built the same way warns nothing."""
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    with pytest.warns(UserWarning, match="nothing in it runs on moeblaze") as seen:
        transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="moeblaze")
    assert len([w for w in seen if "runs on moeblaze" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        transformers.AutoModelForCausalLM.from_config(configs()["olmoe"], experts_implementation="moeblaze")
        transformers.AutoModelForCausalLM.from_config(cfg)  # the default implementation: no word from moeblaze


def test_fp8_under_autocast_quantizes_the_float32_parameters_where_they_lie(monkeypatch):
    """Under autocast (CPU, float16) with precision="fp8", the experts call gets x and the biases in float16 and the
    weights as the float32 parameters themselves (views of them), not half-precision copies; their gradients come
    back float32 (experts.autocast_weights; the op's arithmetic on masters: tests/experts/test_fp8_masters.py)."""
    model = build("gpt_oss", hidden_size=128)
    mbt.configure(model, ExpertsConfig(precision="fp8", fp8_min_rows=0, backend="triton"))
    model.set_experts_implementation("moeblaze")
    seen, real = [], moeblaze.experts.moe_experts

    def spy(x, routing, weights, w1, w2, b1=None, b2=None, **kw):
        seen.append((x.dtype, w1.dtype, w2.dtype, b1.dtype, b2.dtype, w1.untyped_storage().data_ptr()))
        return real(x, routing, weights, w1, w2, b1, b2, **kw)
    monkeypatch.setattr(moeblaze.experts, "moe_experts", spy)
    ids = torch.randint(0, 64, (2, 12))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    experts = model.model.layers[0].mlp.experts
    f16, f32 = torch.float16, torch.float32
    assert seen[0] == (f16, f32, f32, f16, f16, experts.gate_up_proj.untyped_storage().data_ptr())
    grad = experts.gate_up_proj.grad
    assert grad.dtype == f32 and torch.isfinite(grad).all() and grad.abs().sum() > 0
