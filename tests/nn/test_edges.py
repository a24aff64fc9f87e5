"""Edge inputs through the layer and the model: an empty batch on every path (empty output, zero gradients,
zero losses), torch.compile(fullgraph=True) of both implementations, and the environment read once at import."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moeblaze import ExpertsConfig, RoundingConfig
from moeblaze import ModelConfig, MoELayer, MoEModel


@pytest.mark.filterwarnings("ignore:token rounding with")
@pytest.mark.parametrize("chunk_tokens,rounding", [(None, None), (4, None), (None, "nr-f")])
@pytest.mark.parametrize("checkpoint", ["preact", "recompute"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_empty_batch_gives_empty_output_zero_gradients_and_zero_losses(poison_alloc, impl, checkpoint, chunk_tokens,
                                                                        rounding):
    layer = MoELayer(16, 8, 4, 2, experts=ExpertsConfig(checkpoint=checkpoint, chunk_tokens=chunk_tokens,
                                                        backend=impl),
                     rounding=RoundingConfig(rounding) if rounding else None)
    x = torch.randn(2, 0, 16, requires_grad=True)
    out, aux, z = layer(x)
    assert out.shape == x.shape and aux.item() == 0 and z.item() == 0
    (out.square().sum() + aux + z).backward()
    assert x.grad.shape == x.shape
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)), name


def test_model_takes_an_empty_batch():
    model = MoEModel(ModelConfig(max_seq_len=8, d_model=16, n_layers=2, n_heads=2, num_experts=4, d_expert=8))
    logits, aux, z = model(torch.zeros(0, 8, dtype=torch.long))
    assert logits.shape == (0, 8, 256) and aux.item() == 0 and z.item() == 0
    (logits.sum() + aux + z).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_layer_compiles_with_fullgraph_and_matches_eager(impl):
    torch._dynamo.reset()
    # the sort builder: dynamo can't trace Triton's interpreter, which the dense builder runs on here (on a GPU,
    # tests/gpu compiles the dense builder's kernels too)
    layer = MoELayer(16, 8, 4, 2, experts=ExpertsConfig(index_method="sort", backend=impl))
    x = torch.randn(12, 16, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)  # a graph break raises here
    eager = layer(x)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)  # aot_eager runs the same ATen ops as eager: the same bits
    g_c = torch.autograd.grad(compiled.out.square().sum() + compiled.aux_loss, (x, layer.w1, layer.router.weight))
    g_e = torch.autograd.grad(eager.out.square().sum() + eager.aux_loss, (x, layer.w1, layer.router.weight))
    for a, b in zip(g_c, g_e):
        assert torch.equal(a, b)  # aot_eager runs the same ATen ops as eager: the same bits


def _python(code: str, env_interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if env_interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)


def test_interpret_set_after_import_changes_nothing():
    """TRITON_INTERPRET is read once, when the library loads (`import moeblaze` and its first name used): setting
    it later neither breaks the default CPU layer nor half-enables the interpreter."""
    r = _python("""
        import os, torch
        from moeblaze import ExpertsConfig, MoELayer, build_routing_index
        os.environ["TRITON_INTERPRET"] = "1"
        out = MoELayer(16, 8, 4, 2)(torch.randn(5, 16)).out
        assert out.shape == (5, 16) and torch.isfinite(out).all()
        build_routing_index(torch.tensor([[0, 1], [2, 3]]), 4, method="dense")
        try:
            MoELayer(16, 8, 4, 2, experts=ExpertsConfig(backend="triton"))(torch.randn(5, 16))
        except RuntimeError as e:
            print(e)
    """, env_interpret=False)
    assert r.returncode == 0, r.stderr
    assert "backend='triton' runs the Triton kernels, which need a CUDA GPU (x is on cpu)" in r.stdout
    assert "TRITON_INTERPRET=1" in r.stdout
