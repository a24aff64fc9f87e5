"""moeblaze as torchtitan's routed experts (MoeblazeConverter), on torchtitan's own Qwen3 and DeepSeek-V3 debug
models built from its configs (random init, no download; 2 layers, attention on SDPA since FlexAttention has no
CPU backward): the parameter names are torchtitan's, state dicts and DCP checkpoints load both ways, and logits,
every gradient, the losses of a few AdamW steps and the expert-bias state equal torchtitan's own layer run in
fp32 (its grouped_mm casts to bf16, so the default experts get an fp32 GroupedExperts body here; dispatch,
scores and combine stay torchtitan's). The kernels under Triton's interpreter on narrower models from the same
builders; the converter's refusals."""
import types

import pytest
import torch

import moeblaze.experts  # routed_call's moe_experts: what the integrations' calls reach

torchtitan = pytest.importorskip("torchtitan")
from torchtitan.models import llama3, qwen3  # noqa: E402

from moeblaze import EPConfig, ExpertsConfig  # noqa: E402
from moeblaze.integrations.torchtitan import MoeblazeConverter, MoeblazeRoutedExperts  # noqa: E402
from helpers import rel_err  # noqa: E402
from titan import build, fp32_default, model_config  # noqa: E402

TOL = 1e-5  # fp32 on both sides: the summation order differs


def pair(family, experts: ExpertsConfig, narrow=False):
    """(torchtitan's model with fp32 experts, the same weights on moeblaze's experts)."""
    default = fp32_default(build(model_config(family, narrow=narrow)))
    ours = build(model_config(family, [MoeblazeConverter.Config(experts=experts)], narrow=narrow), seed=1)
    ours.load_state_dict(default.state_dict())
    return default, ours


def tokens(vocab, B=2, L=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, L), generator=g), torch.randint(0, vocab, (B, L), generator=g)


def moe_layers(model):
    return [m for m in model.modules() if type(m).__name__ == "MoE"]


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_names_are_torchtitans_and_state_dicts_load_both_ways(family):
    default = build(model_config(family))
    ours = build(model_config(family, [MoeblazeConverter.Config()]), seed=1)
    assert any(isinstance(m, MoeblazeRoutedExperts) for m in ours.modules())
    assert list(default.state_dict()) == list(ours.state_dict())
    assert [n for n, _ in default.named_parameters()] == [n for n, _ in ours.named_parameters()]
    ours.load_state_dict(default.state_dict())  # strict, and back
    default.load_state_dict(ours.state_dict())


@pytest.mark.parametrize("family,backend,narrow,checkpoint", [
    ("qwen3", "reference", False, "preact"), ("deepseek_v3", "reference", False, "preact"),  # the debug models
    ("qwen3", "triton", True, "preact"), ("qwen3", "triton", True, "recompute")])  # the kernels, interpreted
def test_training_steps_equal_torchtitans_layer_in_fp32(family, backend, narrow, checkpoint):
    """Three AdamW steps on fresh tokens, with torchtitan's load balancing (the expert bias moves by the sign of
    the load's deviation, as its optimizer hook does): logits and every gradient at step 0, each step's loss,
    and the expert biases and token counts after."""
    default, ours = pair(family, ExpertsConfig(backend=backend, checkpoint=checkpoint), narrow)
    vocab = default.tok_embeddings.num_embeddings
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (default, ours)]
    for step in range(3):
        x, y = tokens(vocab, seed=step)
        losses = []
        for model, opt in zip((default, ours), opts):
            opt.zero_grad()
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            losses.append((logits, loss))
        if step == 0:
            assert rel_err(losses[1][0], losses[0][0]) < TOL
            for (name, a), (_, b) in zip(default.named_parameters(), ours.named_parameters()):
                assert b.grad is not None and rel_err(b.grad, a.grad) < TOL, name
        assert abs(losses[1][1].item() - losses[0][1].item()) < TOL * abs(losses[0][1].item())
        for model, opt in zip((default, ours), opts):
            opt.step()
            with torch.no_grad():
                for moe in moe_layers(model):
                    if moe.expert_bias_E is not None:
                        load = moe.tokens_per_expert_E
                        moe.expert_bias_E.add_(1e-3 * torch.sign(load.mean() - load))
    for a, b in zip(moe_layers(default), moe_layers(ours)):
        assert torch.equal(a.tokens_per_expert_E, b.tokens_per_expert_E)
        if a.expert_bias_E is not None:
            assert torch.equal(a.expert_bias_E, b.expert_bias_E)


def test_bf16_within_torchtitans_own_error():
    """bf16 (the reference path on the CPU): moeblaze's logits and gradients no farther from the fp32 model than
    2x torchtitan's own grouped_mm path is."""
    truth, ours = pair("deepseek_v3", ExpertsConfig(backend="reference"))
    default = build(model_config("deepseek_v3"))
    default.load_state_dict(truth.state_dict())
    x, y = tokens(default.tok_embeddings.num_embeddings)
    results = []
    for model in (truth, default.bfloat16(), ours.bfloat16()):
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        results.append([logits] + [p.grad for p in model.parameters()])
    for t, d, o in zip(*results):
        assert rel_err(o, t) <= 2 * rel_err(d, t) + 1e-3


def test_dcp_checkpoints_interchange(tmp_path):
    """A DCP checkpoint torchtitan's model wrote loads into the converted model, and the other way; both then
    compute the same logits."""
    import torch.distributed.checkpoint as dcp

    default, ours = pair("qwen3", ExpertsConfig(backend="reference"))
    x, _ = tokens(default.tok_embeddings.num_embeddings)
    dcp.save(default.state_dict(), checkpoint_id=tmp_path / "a")
    fresh = build(model_config("qwen3", [MoeblazeConverter.Config(experts=ExpertsConfig(backend="reference"))]), 5)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "a")
    fresh.load_state_dict(state)
    assert rel_err(fresh(x), default(x)) < TOL
    dcp.save(ours.state_dict(), checkpoint_id=tmp_path / "b")
    back = fp32_default(build(model_config("qwen3"), 6))
    state = back.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "b")
    back.load_state_dict(state)
    assert rel_err(back(x), ours(x)) < TOL


@pytest.mark.parametrize("make,message", [
    (lambda: MoeblazeConverter.Config(experts=ExpertsConfig(activation="geglu")), "SwiGLU"),
    (lambda: MoeblazeConverter.Config(experts=ExpertsConfig(precision="fp8", fp8_weight_cache=True)),
     "fp8_weight_cache"),
    (lambda: MoeblazeConverter.Config(experts="recompute"), "ExpertsConfig"),
    (lambda: MoeblazeConverter.Config(ep="exact"), "ep must be a moeblaze.EPConfig"),
    (lambda: MoeblazeConverter.Config(ep=EPConfig(dispatch="deepep")), "dispatch"),
    (lambda: MoeblazeConverter.Config(ep=EPConfig(dispatch="capacity", on_overflow="grow")), "on_overflow"),
    (lambda: MoeblazeConverter.Config(ep=EPConfig(dispatch="capacity", capacity_factor=0.0)), "capacity_factor"),
    (lambda: MoeblazeConverter.Config(experts=ExpertsConfig(backend="reference"), ep=EPConfig()), "reference"),
    (lambda: MoeblazeConverter.Config(ep=EPConfig(dispatch="capacity", chunks=0)), "chunks"),
    (lambda: MoeblazeConverter.Config(ep_dispatch="exact"), "ep_dispatch"),  # the flat fields of before: EPConfig
])
def test_converter_options_are_checked(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make().build()


def test_converter_refuses_what_it_cant_run():
    converter = MoeblazeConverter.Config().build()
    with pytest.raises(ValueError, match="no MoE layers"):
        converter.convert(llama3.model_registry("debugmodel").model)
    with pytest.raises(ValueError, match="already converted"):
        converter.convert(converter.convert(model_config("qwen3")))
    with pytest.raises(ValueError, match="DeepEP"):
        converter.convert(qwen3.model_registry("debugmodel_moe", moe_comm_backend="deepep").model)
    from torchtitan.models import gpt_oss

    with pytest.raises(ValueError, match="GptOss"):
        converter.convert(gpt_oss.model_registry("debugmodel").model)


def test_tensor_parallelism_is_refused_by_name():
    ours = build(model_config("qwen3", [MoeblazeConverter.Config()]))
    experts = next(m for m in ours.modules() if isinstance(m, MoeblazeRoutedExperts))
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        experts.parallelize(types.SimpleNamespace(tp_enabled=True, etp_enabled=False))


def test_moeblaze_ep_refuses_experts_the_ep_mesh_did_not_shard():
    """ep_dispatch="exact" on an EP mesh of 2 whose rank holds all 8 experts (a model config built without
    update_from_config(parallelism)): one clear error, not every row sent to rank 0."""
    ours = build(model_config("qwen3", [MoeblazeConverter.Config(ep=EPConfig())]))
    for m in ours.modules():
        if isinstance(m, MoeblazeRoutedExperts):
            m.token_dispatcher.ep_mesh = types.SimpleNamespace(size=lambda: 2, get_group=lambda: None)
    with pytest.raises(RuntimeError, match="did not shard"):
        ours(torch.randint(0, 100, (1, 8)))


def test_torchtitans_block_compile_with_moeblaze_inside():
    """torchtitan's apply_compile (torch.compile of every transformer block) with moeblaze's experts inside (the
    custom ops traced; aot_eager, the index built by sort, as dynamo can't trace the interpreter's launch of the
    dense builder): logits and every gradient equal the eager model's."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    torch._dynamo.reset()
    experts = ExpertsConfig(backend="triton", index_method="sort")
    eager = build(model_config("qwen3", [MoeblazeConverter.Config(experts=experts)], narrow=True))
    compiled = build(model_config("qwen3", [MoeblazeConverter.Config(experts=experts)], narrow=True), seed=3)
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled, compile_config=CompileConfig(enable=True, backend="aot_eager"),
                  parallel_dims=types.SimpleNamespace(tp_enabled=False))
    assert all(block._compiled_call_impl is not None for block in compiled.layers.values())  # fullgraph=True
    x, _ = tokens(eager.tok_embeddings.num_embeddings)
    outs = [model(x) for model in (eager, compiled)]
    for out in outs:
        out.square().mean().backward()
    assert rel_err(outs[1], outs[0]) < TOL
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        assert rel_err(b.grad, a.grad) < TOL, name


def test_fp8_under_autocast_quantizes_the_float32_parameters_where_they_lie(monkeypatch):
    """Under autocast (CPU, float16) with precision="fp8" the op gets x in float16 and w1, w3 and w2 as the float32
    parameters themselves, not half-precision copies; their gradients come back float32."""
    model = build(model_config("qwen3", [MoeblazeConverter.Config(
        experts=ExpertsConfig(precision="fp8", fp8_min_rows=0, backend="triton"))], narrow=True))
    seen, real = [], moeblaze.experts.moe_experts

    def spy(x, routing, weights, w1, w2, *args, **kw):
        seen.append((x.dtype, w1[0].dtype, w1[1].dtype, w2.dtype, w1[0].data_ptr()))
        return real(x, routing, weights, w1, w2, *args, **kw)
    monkeypatch.setattr(moeblaze.experts, "moe_experts", spy)
    x, y = tokens(model.tok_embeddings.num_embeddings)
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(x)
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
    experts = next(m for m in model.modules() if isinstance(m, MoeblazeRoutedExperts)).inner_experts
    f16, f32 = torch.float16, torch.float32
    assert seen and seen[0] == (f16, f32, f32, f32, experts.w1_EFD.data_ptr())
    for p in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD):
        assert p.grad.dtype == f32 and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
