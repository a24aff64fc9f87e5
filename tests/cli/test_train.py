import argparse
import os

import pytest
import torch

from moeblaze.cli import main, train
from moeblaze.cli.data import builtin_corpus, split_corpus, unigram_entropy


def args_for(tmp_path, **over):
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    a = p.parse_args([])
    base = dict(steps=30, batch_size=8, seq_len=32, d_model=32, n_layers=1, n_heads=2, num_experts=4, top_k=2,
                d_expert=32, eval_every=30, eval_batches=2, save=str(tmp_path / "ck.pt"), save_every=15,
                device="cpu")
    for k, v in {**base, **over}.items():
        setattr(a, k, v)
    return a


def test_corpus_is_builtin_and_entropy_is_sane():
    train_t, val_t = split_corpus(builtin_corpus())
    assert len(train_t) > 100_000 and len(val_t) > 10_000
    assert 2.5 < unigram_entropy(train_t) < 5.6  # bytes of English text: ~4.5-5 bits


def test_short_training_run_learns_and_checkpoints(tmp_path):
    res = train.run(args_for(tmp_path, steps=200, eval_every=100, batch_size=16))
    assert res["val_loss"] < res["unigram_entropy"]
    ck = torch.load(tmp_path / "ck.pt", weights_only=False)
    assert ck["step"] == 200 and not [f for f in os.listdir(tmp_path) if ".tmp." in f]


def test_resume_continues_from_the_saved_step(tmp_path, capsys):
    train.run(args_for(tmp_path, steps=15))
    res = train.run(args_for(tmp_path, steps=30, resume=True))
    assert "resumed from" in capsys.readouterr().out and res["step"] == 30


def test_resume_rejects_a_different_model(tmp_path):
    train.run(args_for(tmp_path, steps=15))
    with pytest.raises(SystemExit, match="differs"):
        train.run(args_for(tmp_path, steps=30, resume=True, d_model=64))


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ck.pt")
    train.save_checkpoint(path, {"step": 1})

    def crash(obj, f):
        open(f, "wb").write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        train.save_checkpoint(path, {"step": 2})
    monkeypatch.undo()
    assert torch.load(path, weights_only=False)["step"] == 1


def test_cli_entry_point(tmp_path):
    assert main(["train", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--d-model", "16", "--n-layers",
                 "1", "--n-heads", "2", "--num-experts", "4", "--d-expert", "16", "--eval-every", "2",
                 "--eval-batches", "1", "--save", ""]) == 0
