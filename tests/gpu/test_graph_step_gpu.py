"""On a CUDA GPU (`pytest -m gpu`): `moeblaze train --cuda-graph` is the eager run, bitwise. Every step's loss
and gradient norm and the validation losses (one taken between graph replays, which must see the parameters of
that step) are compared as the loss log writes them. Several GPUs: `bash scripts/scaling.sh graph`."""
import argparse
import json

import pytest
import torch

from moeblaze.cli import train, train_flags
from moeblaze.cli.graph_step import GraphedStep

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _log(tmp_path, name, **over):
    p = argparse.ArgumentParser()
    train_flags.add_arguments(p)
    a = p.parse_args([])
    log = tmp_path / f"{name}.jsonl"
    base = dict(steps=12, batch_size=8, eval_every=5, eval_batches=2, save="", device="cuda", dtype="bfloat16",
                loss_log=str(log))
    for k, v in {**base, **over}.items():
        setattr(a, k, v)
    train.run(train_flags.check_flags(a))
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("over", [{}, {"precision": "fp8", "fp8_min_rows": 0}, {"checkpoint_policy": "recompute"},
                                  {"router": "deepseek-v3", "num_experts": 16}],
                         ids=["bf16", "fp8", "recompute", "expert-bias"])
def test_the_graphed_step_is_the_eager_step(tmp_path, over):
    if over.get("precision") == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89+")
    eager = _log(tmp_path, "eager", **over)
    graphed = _log(tmp_path, "graphed", cuda_graph=True, **over)
    assert len(eager) == 12 + 3 and sum("val_loss" in r for r in eager) == 3
    assert graphed == eager


@pytest.mark.parametrize("units", ["blocks", "model"])
def test_the_graphed_step_is_the_eager_step_under_fsdp2(tmp_path, monkeypatch, units):
    """FSDP2 on a one-rank NCCL group, as `torchrun --nproc-per-node 1` starts it: the units' all-gathers and
    reduce-scatters, with their streams and hooks, captured with the step; the graphed run is the eager run,
    bitwise. Two ranks and more: `bash scripts/scaling.sh graph`."""
    from helpers import free_port

    from moeblaze.cli import parallel

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                     TORCHELASTIC_RUN_ID="test").items():  # what torchrun sets
        monkeypatch.setenv(k, v)
    wrapped = []
    real = parallel.parallelize_model
    monkeypatch.setattr(parallel, "parallelize_model",
                        lambda model, ranks, cfg: wrapped.append(cfg.parallel.units) or real(model, ranks, cfg))
    eager = _log(tmp_path, "eager", fsdp_units=units)
    graphed = _log(tmp_path, "graphed", cuda_graph=True, fsdp_units=units)
    assert wrapped == [units, units]  # both runs under FSDP2
    assert len(eager) == 12 + 3 and graphed == eager


def test_a_graphed_step_refuses_other_shapes():
    step = GraphedStep(lambda x: (x * 2,))
    x = torch.ones(4, device="cuda")
    for _ in range(3):
        (y,) = step(x)
    assert torch.equal(y, x * 2)
    (y,) = step(torch.full((4,), 3.0, device="cuda"))
    assert torch.equal(y, torch.full((4,), 6.0, device="cuda"))
    with pytest.raises(ValueError, match="same shapes"):
        step(torch.ones(5, device="cuda"))
