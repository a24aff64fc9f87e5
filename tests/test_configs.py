"""The layer's configs: one frozen value per concern, each rule checked in one place, torch-free; 0.2's keyword forms
build the same layers with a DeprecationWarning that names the new form; ModelConfig round-trips and reads the
earlier checkpoint forms."""
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

from moeblaze import EPConfig, ExpertsConfig, ModelConfig, MoELayer, RoundingConfig, RouterConfig, SharedConfig
from moeblaze.configs import ROUTERS
from moeblaze.experts.schedule import BLOCK_M
from moeblaze.routing import TopKRouter

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "moeblaze"

# each rule of the layer's options and the text of its one check (the error's wording, or the check's call)
RULES = {
    "top_k <= num_experts": r"top.k must (satisfy 1 <=|be <=) (top.k|--num-experts|num.experts)",
    "d_model % n_heads": r"must be divisible by n_heads",
    "groups divide the experts": r"must divide num_experts",
    "groups hold top_k": r"must be <= topk_groups x experts per group",
    "capacity_factor": r"check_positive\(\"capacity_factor\"",
    "capacity options need capacity dispatch": r"applies to dispatch='capacity' only",
    "shared experts' options need shared experts": r"configures shared experts",
    "rounding's options need a rule": r"configures token rounding",
    "rounding's rule": r"check_choice\(\"rule\"",
    "rounding's max_experts >= top_k": r"max_experts must be >= top_k",
    "the router's scoring": r"check_choice\(\"scoring\"",
    "the router's family": r"check_choice\(\"router\"",
}


def test_every_rule_is_checked_in_one_place():
    text = {p: p.read_text() for p in SRC.rglob("*.py")}
    for rule, pattern in RULES.items():
        where = [f"{p.relative_to(SRC)}" for p, t in text.items() for _ in re.finditer(pattern, t)]
        assert len(where) == 1, (rule, where)


def test_the_configs_load_without_torch():
    code = ("import sys, moeblaze.configs as c; c.ModelConfig(router=c.RouterConfig.family('deepseek-v3'), "
            "num_experts=16, shared=c.SharedConfig(), rounding=c.RoundingConfig('up')); c.EPConfig('capacity'); "
            "print(sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_configs_are_frozen_and_unset_is_none():
    with pytest.raises(AttributeError):
        RouterConfig().scoring = "sigmoid_topk"
    assert (EPConfig().capacity_factor, EPConfig().on_overflow, RoundingConfig().tile, SharedConfig().d_hidden) == (
        None, None, None, None)
    assert (EPConfig("capacity").factor, EPConfig("capacity").overflow) == (1.25, "error")
    assert RouterConfig.family("deepseek-v3") is ROUTERS["deepseek-v3"]
    layer = MoELayer(16, 32, 8, 2, rounding=RoundingConfig("up"))
    assert layer.rounding == RoundingConfig("up", tile=BLOCK_M, max_experts=8)  # resolved where the layer is made


def _state(layer):
    return {k: v.clone() for k, v in layer.state_dict().items()}


@pytest.mark.parametrize("call", [
    lambda: MoELayer(16, 32, 8, 2, router="deepseek-v3"),
    lambda: MoELayer(16, 32, 8, 2, shared_experts=1),
    lambda: MoELayer(16, 32, 8, 2, token_rounding="up"),
    lambda: TopKRouter(16, 8, 2, scoring="sigmoid_topk"),
    lambda: ModelConfig(router="olmoe"),
    lambda: ModelConfig(shared_experts=1),
])
def test_the_unreleased_layer_forms_are_refused(call):
    """The layer options as names and keyword arguments were never released: only the configs take them."""
    with pytest.raises(TypeError, match="must be a moeblaze|unexpected keyword"):
        call()


def test_model_config_round_trips_and_reads_the_earlier_forms():
    cfg = ModelConfig(num_experts=16, router=RouterConfig.family("deepseek-v3"), shared=SharedConfig(d_hidden=64),
                      rounding=RoundingConfig("nr-f", tile=16), experts=ExpertsConfig(checkpoint="recompute"))
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    earlier = dict(num_experts=16, router="deepseek-v3", shared_experts=1, d_shared=64, shared_gate=False,
                   token_rounding="nr-f", rounding_tile=16, checkpoint="recompute")  # 0.1's and 0.2's flat fields
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checkpoint's config loads quietly
        assert ModelConfig.from_dict(earlier) == cfg
    unset = dict(num_experts=16, router="default", shared_experts=0, d_shared=0, shared_gate=False,
                 token_rounding="", rounding_tile=0)  # how 0.2 wrote "none"
    assert ModelConfig.from_dict(unset) == ModelConfig(num_experts=16)


def test_fp8_min_rows_decides_each_calls_precision():
    """ExpertsConfig.at_call: precision="fp8" turns "native" (the weight cache with it) where a call's experts average
    fewer than fp8_min_rows rows (per chunk with chunk_tokens); otherwise the config itself; 0: always e4m3."""
    fp8 = ExpertsConfig(precision="fp8", fp8_weight_cache=True)
    assert fp8.fp8_min_rows == 2048
    assert fp8.at_call(8192, 8, 32) is fp8  # 2048 rows per expert
    assert fp8.at_call(8191, 8, 32) == fp8.replace(precision="native", fp8_weight_cache=False)
    assert fp8.replace(chunk_tokens=4096).at_call(65536, 8, 32).precision == "native"  # 1024 rows per chunk
    assert fp8.replace(fp8_min_rows=0).at_call(1, 1, 64).precision == "fp8"
    assert ExpertsConfig().at_call(1, 1, 64) == ExpertsConfig()
    with pytest.raises(ValueError, match="fp8_min_rows"):
        ExpertsConfig(precision="fp8", fp8_min_rows=-1)
    with pytest.raises(TypeError, match="fp8_min_rows"):
        ExpertsConfig(precision="fp8", fp8_min_rows=2048.0)


def test_the_recipe_is_experts_everywhere_and_config_its_deprecated_name():
    """moe_experts, the reference, Experts and transformers' configure take the recipe as experts=; config=, its 0.2
    name, gives the same result with a DeprecationWarning that names experts=; both at once are refused."""
    import torch

    from moeblaze import build_routing_index, moe_experts
    from moeblaze.nn import Experts
    from moeblaze.reference import moe_experts_reference

    torch.manual_seed(0)
    x, w1, w2 = torch.randn(6, 8), torch.randn(3, 16, 8), torch.randn(3, 8, 8)
    idx, w = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1]]), torch.rand(6, 2)
    recipe = ExpertsConfig(backend="reference", checkpoint="recompute")
    calls = {"moe_experts": lambda **k: moe_experts(x, build_routing_index(idx, 3), w, w1, w2, **k),
             "moe_experts_reference": lambda **k: moe_experts_reference(x, idx, w, w1, w2, **k),
             "Experts": lambda **k: Experts(8, 8, 3, **k).config}
    for name, call in calls.items():
        want = call(experts=recipe)
        said = rf"{name}\(config=\.\.\.\) is deprecated .* pass experts="
        with pytest.warns(DeprecationWarning, match=said) as caught:
            got = call(config=recipe)
        assert caught[0].filename == __file__, (name, caught[0].filename)  # said at the caller's line
        assert got == want if isinstance(want, ExpertsConfig) else torch.equal(got, want), name
        with pytest.raises(TypeError, match="experts= only"):
            call(experts=recipe, config=recipe)
