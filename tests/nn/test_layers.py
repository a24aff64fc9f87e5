import pytest
import torch

from moeblaze import ExpertsConfig
from moeblaze import ModelConfig, MoELayer, MoEModel
from moeblaze.reference import moe_experts_reference


def test_moe_layer_matches_reference_and_keeps_shape():
    layer = MoELayer(24, 16, 6, 2, experts=ExpertsConfig(backend="reference"))
    x = torch.randn(3, 5, 24)
    out, aux, z = layer(x)
    assert out.shape == x.shape and aux.ndim == 0 and z.ndim == 0
    r = layer.router(x.reshape(-1, 24))
    ref = moe_experts_reference(x.reshape(-1, 24), r.topk_idx, r.topk_weights, layer.w1, layer.w2)
    assert torch.allclose(out.reshape(-1, 24), ref)


def test_triton_and_reference_layers_agree():
    """The kernels' layer within twice the fp32 reference's error against the fp64 one, output and gradients."""
    from helpers import assert_within_torch_error

    ref = MoELayer(32, 16, 4, 2, experts=ExpertsConfig(backend="reference"))
    tri = MoELayer(32, 16, 4, 2, experts=ExpertsConfig(checkpoint="recompute", backend="triton"))
    tri.load_state_dict(ref.state_dict())
    exact = MoELayer(32, 16, 4, 2, experts=ExpertsConfig(backend="reference")).double()
    exact.load_state_dict({k: v.double() for k, v in ref.state_dict().items()})
    x = torch.randn(20, 32)
    (a, _, _), (b, _, _), (c, _, _) = ref(x), tri(x), exact(x.double())
    assert_within_torch_error(b, a, c)
    for y in (a, b, c):
        y.square().sum().backward()
    for p, q, r in zip(ref.parameters(), tri.parameters(), exact.parameters()):
        assert_within_torch_error(q.grad, p.grad, r.grad)


def test_layer_gradients_reach_every_parameter():
    layer = MoELayer(16, 8, 4, 2, experts=ExpertsConfig(activation="gelu"))
    out, aux, z = layer(torch.randn(30, 16))
    (out.square().mean() + 0.01 * aux + 0.001 * z).backward()
    for n, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


@pytest.mark.parametrize("kwargs,match", [
    (dict(activation="tanh"), "activation"), (dict(checkpoint="x"), "checkpoint"), (dict(backend="cuda"), "backend"),
    (dict(index_method="radix"), "index_method"), (dict(fp8_weight_cache=True), "fp8_weight_cache"),
    (dict(chunk_tokens=0), "chunk_tokens")])
def test_layer_bad_config(kwargs, match):
    """Every refused recipe is refused where the config is made, naming the choice."""
    with pytest.raises(ValueError, match=match):
        MoELayer(16, 8, 4, 2, experts=ExpertsConfig(**kwargs))


def test_layer_bad_input_shape():
    with pytest.raises(ValueError, match="last dimension"):
        MoELayer(16, 8, 4, 2)(torch.randn(4, 15))


def test_model_forward_and_short_training_lowers_loss():
    cfg = ModelConfig(max_seq_len=16, d_model=32, n_layers=1, n_heads=2, num_experts=4, top_k=2, d_expert=32)
    model = MoEModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 8, (8, 17))  # a tiny vocabulary: learnable in a few steps
    losses = []
    for _ in range(30):
        logits, aux, z = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        opt.zero_grad()
        (loss + 0.01 * aux + 0.001 * z).backward()
        opt.step()
        losses.append(loss.item())
    assert logits.shape == (8, 16, 256)
    assert losses[-1] < 0.7 * losses[0]


def test_state_dicts_with_the_earlier_expert_keys_load():
    """Before the experts submodule, w1 and w2 were the layer's own parameters: such state dicts still load."""
    layer = MoELayer(24, 16, 4, 2)
    old = {("w1" if k == "experts.w1" else "w2" if k == "experts.w2" else k): v.clone() + 1
           for k, v in layer.state_dict().items()}
    assert "w1" in old and "experts.w1" not in old
    fresh = MoELayer(24, 16, 4, 2)
    fresh.load_state_dict(old)
    assert torch.equal(fresh.experts.w1, old["w1"]) and torch.equal(fresh.w2, old["w2"])
