"""The combine kernel (interpreter) against its definition, out[t] = sum_k w[t, k] · rows[token_slot[t, k]] with
slots >= kept adding nothing, in fp64: top-k tables (summed over every column) and wide ones (token rounding's,
summed up to each token block's last used column), with used columns anywhere in a token's row."""
import pytest
import torch

from moeblaze.experts.tl import launchers

from helpers import assert_within_torch_error


def _reference(rows, slot, w, kept, dtype=torch.float64):
    used = slot < kept
    r = torch.where(used[..., None], rows.to(dtype)[slot.long()], 0.0)
    if w is not None:
        r = r * w.to(dtype)[..., None]
    return r.sum(1)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("K,spread", [(4, False), (32, False), (32, True), (12, True)])
def test_combine_is_its_definition(poison_alloc, K, spread, weighted):
    gen = torch.Generator().manual_seed(K + spread)
    L, D, R = 45, 40, 300
    kept = 250
    rows = torch.randn(R + 1, D, generator=gen)
    rows[kept:] = float("nan")  # dropped rows hold anything: never read
    n_used = torch.randint(0, min(K, 9) + 1, (L,), generator=gen)
    n_used[20:36] = 0  # a whole token block (16 tokens) with no pair
    slot = torch.full((L, K), R, dtype=torch.int32)
    for t in range(L):
        cols = torch.randperm(K, generator=gen)[:n_used[t]] if spread else torch.arange(n_used[t])
        slot[t, cols] = torch.randint(0, kept, (int(n_used[t]),), generator=gen, dtype=torch.int32)
    if K == 32:
        slot[3, K - 1] = 7  # the last column used by one token
    w = torch.rand(L, K, generator=gen)
    out = launchers.combine(rows, slot, w if weighted else None, torch.tensor([kept], dtype=torch.int32),
                            torch.float32)
    want = _reference(rows, slot, w if weighted else None, kept)
    assert torch.isfinite(out).all()
    assert_within_torch_error(out, _reference(rows, slot, w if weighted else None, kept, torch.float32), want)
    assert (out[20:36] == 0).all()
