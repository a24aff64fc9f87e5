"""The built-in corpus: the byte-level text of Python's own help topics (pydoc_data.topics), which
ships with every CPython installation, so training needs no download."""
from __future__ import annotations

import math

import torch


def builtin_corpus() -> bytes:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")


def split_corpus(data: bytes, val_fraction: float = 0.1):
    """(train, val) uint8 tensors: the last val_fraction of the text is held out."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n_val = int(len(t) * val_fraction)
    return t[:-n_val], t[-n_val:]


def unigram_entropy(t: torch.Tensor) -> float:
    """Entropy in nats of the byte frequencies: the loss of the best model that ignores context."""
    p = torch.bincount(t.long(), minlength=256).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def random_batch(t: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator):
    """(inputs, targets) int64 (B, T) windows at random offsets."""
    starts = torch.randint(0, len(t) - seq_len - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    w = t[idx].long()
    return w[:, :-1], w[:, 1:]


def bits(nats: float) -> float:
    return nats / math.log(2)
