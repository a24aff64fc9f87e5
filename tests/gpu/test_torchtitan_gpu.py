"""On a CUDA GPU (`pytest -m gpu`): torchtitan's Qwen3 and DeepSeek-V3 debug models (2 layers) in bf16 with
moeblaze's experts on the compiled kernels, against the same model in fp32 with torchtitan's experts computed in
fp32: logits and every gradient within FACTOR x the error of torchtitan's own bf16 grouped_mm path."""
import pytest
import torch

pytest.importorskip("torchtitan")
from moeblaze import ExpertsConfig  # noqa: E402
from moeblaze.integrations.torchtitan import MoeblazeConverter  # noqa: E402
from titan import build, fp32_default, model_config  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FACTOR = 2.0


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
@pytest.mark.parametrize("experts", [dict(checkpoint="preact"), dict(checkpoint="recompute")])
def test_bf16_model_within_torchtitans_own_error(family, experts):
    truth = fp32_default(build(model_config(family), device="cuda"))
    default = build(model_config(family), device="cuda")
    ours = build(model_config(family, [MoeblazeConverter.Config(experts=ExpertsConfig(**experts))]), device="cuda")
    default.load_state_dict(truth.state_dict())
    ours.load_state_dict(truth.state_dict())
    g = torch.Generator(device="cuda").manual_seed(0)
    vocab = truth.tok_embeddings.num_embeddings
    x, y = (torch.randint(0, vocab, (4, 512), device="cuda", generator=g) for _ in range(2))
    results = []
    for model in (truth, default.bfloat16(), ours.bfloat16()):
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        results.append([logits] + [p.grad for p in model.parameters()])
    names = ["logits"] + [n for n, _ in truth.named_parameters()]
    for name, t, d, o in zip(names, *results):
        assert torch.isfinite(o).all() and _rel(o, t) <= FACTOR * _rel(d, t) + 1e-4, (name, _rel(o, t), _rel(d, t))
