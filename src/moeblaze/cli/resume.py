"""`moeblaze train --resume`: what a checkpoint holds, the checks that it is this model's (by name: another shape, a
missing entry, a config of another model), and the loading of it, single-file or sharded (rank 0's view of the
folders decides for every rank).

Memory: the checkpoint's tensors as loaded (the model's and the optimizer's state), then the model's own.
"""
from __future__ import annotations

import json
import os

import torch

from ..nn import ModelConfig
from . import UsageError
from .checkpoint import CheckpointError, load_checkpoint, load_newest_sharded, load_sharded
from .train_setup import sharded_save


def train_state(model, opt, step: int, gen, cfg, sharded: bool):
    """What a checkpoint holds; in a sharded one the state dicts come from torch.distributed.checkpoint's helpers
    (DTensor shards under torchrun) and the config is a JSON string."""
    if not sharded:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "generator": gen.get_state(), "config": cfg.to_dict()}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd, "train": {"step": step, "generator": gen.get_state(),
                                                      "config": json.dumps(cfg.to_dict(), sort_keys=True)}}


# How a run computes, not what its model is: a checkpoint resumes under other values of these.
EXECUTION = {"rounding"}
EXECUTION_EXPERTS = {"checkpoint", "backend", "precision", "fp8_weight_cache", "fp8_min_rows", "chunk_tokens",
                     "index_method"}


def _meaning(d: dict) -> dict:
    """A config's fields that make the model what it is (its shape, routing and activation), the configs' fields
    as "router.scoring" and so on."""
    out = {}
    for k, v in d.items():
        if k in EXECUTION:
            continue
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items() if not (k == "experts" and kk in EXECUTION_EXPERTS)})
        else:
            out[k] = v
    return out


def _same_config(saved, cfg: ModelConfig) -> None:
    """UsageError unless the checkpoint's model is the flags' (fields added since it was saved: their defaults;
    execution choices such as the kernels, the checkpoint policy or token rounding may differ); it names the
    fields that differ."""
    try:
        saved = ModelConfig.from_dict(saved).to_dict()
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise UsageError(f"--resume: the checkpoint's config is not one this version reads ({e})") from None
    old, new = _meaning(saved), _meaning(cfg.to_dict())
    differ = [f"{k} (checkpoint {old.get(k)!r}, flags {new.get(k)!r})" for k in sorted(set(old) | set(new))
              if old.get(k) != new.get(k)]
    if differ:
        raise UsageError(f"--resume: the checkpoint is of another model: {'; '.join(differ)}")


def _check_single_file(ck) -> None:
    """UsageError unless a checksummed checkpoint holds what this version writes."""
    missing = [k for k in ("model", "optimizer", "step", "generator", "config")
               if not isinstance(ck, dict) or k not in ck]
    if missing:
        raise UsageError(f"--resume: the checkpoint lacks {', '.join(missing)}: not a moeblaze train checkpoint")
    if isinstance(ck["step"], bool) or not isinstance(ck["step"], int) or ck["step"] < 0:
        raise UsageError(f"--resume: the checkpoint's step is {ck['step']!r}, not a step count")


def _load_or_refuse(what: str, load) -> None:
    """load(), with a state that does not fit the model refused in one line (a tensor of another shape, a missing
    or extra entry)."""
    try:
        load()
    except (RuntimeError, KeyError, ValueError) as e:
        raise UsageError(f"--resume: the checkpoint's {what} does not fit: {str(e).splitlines()[0][:300]}") from None


def _check_shapes(saved: dict, current: dict) -> None:
    """UsageError naming the first tensor of the checkpoint whose shape is not the model's, with both shapes."""
    for name, t in current.items():
        v = saved.get(name) if isinstance(saved, dict) else None
        if isinstance(v, torch.Tensor) and v.shape != t.shape:
            raise UsageError(f"--resume: the checkpoint's {name} has shape {tuple(v.shape)}, the model's "
                             f"{tuple(t.shape)}")


def resume(save: str, model, opt, gen, cfg, device, ranks) -> int:
    """The step of the checkpoint at `save`, loaded into model, opt and gen (SystemExit if it can't be)."""
    if not sharded_save(save, ranks is not None):
        try:
            ck = load_checkpoint(save, map_location=device)
        except CheckpointError as e:
            raise UsageError(f"--resume: {e}") from None
        _check_single_file(ck)
        _same_config(ck["config"], cfg)
        _check_shapes(ck["model"], model.state_dict())
        _load_or_refuse("model", lambda: model.load_state_dict(ck["model"]))
        _load_or_refuse("optimizer state", lambda: opt.load_state_dict(ck["optimizer"]))
        gen.set_state(ck["generator"].cpu())
        return ck["step"]
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = train_state(model, opt, 0, gen, cfg, True)
    state["train"]["config"] = ""
    rank = ranks.rank if ranks else 0
    try:  # the config first, alone: a checkpoint of another shape is refused by name before any tensor is read
        folder = load_newest_sharded(save, {"train": state["train"]}, rank)
    except CheckpointError as e:
        raise UsageError(f"--resume: {e}") from None
    if folder != save.rstrip("/" + os.sep):
        if rank == 0:
            print(f"--resume: reading {folder} (left by a save that was stopped before it finished)")
    try:
        _same_config(json.loads(state["train"]["config"]), cfg)
        load_sharded(folder, state, rank)
    except CheckpointError as e:
        raise UsageError(f"--resume: {e}") from None
    _load_or_refuse("state", lambda: set_state_dict(model, opt, model_state_dict=state["model"],
                                                    optim_state_dict=state["optimizer"]))
    gen.set_state(state["train"]["generator"].cpu())
    return int(state["train"]["step"])
