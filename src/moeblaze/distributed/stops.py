"""How an expert-parallel layer call stops every rank together: the counts every transport sends ahead of its rows
(exchange) carry each rank's code beside them, 1 where that rank refused its inputs (refuse: it makes the exchange
and nothing after), else the signature of the values its call agreed on (distributed.ep.check_agreement). Each
rank then holds every rank's code and stops on the same verdict without a collective more: REFUSED where one
refused, Disagreed where the signatures differ (a group's calls after its first are checked here only: ranks that
passed values each agreed before, but not the same ones, would otherwise go on into collectives that don't match).

Memory: one int64 column beside the counts.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from ..routing.checks import fail_if

REFUSED = ("every rank of the expert-parallel group stops: a rank refused its inputs in this call (its own error "
           "names them)")
DIFFER = ("every rank of the expert-parallel group stops: the ranks' calls differ in what must agree (the recipe, "
          "the EPConfig, the dtypes and shapes), though each rank's was agreed in an earlier call")
STOPPED = ("every rank of the expert-parallel group stops: a rank refused its inputs in this call, or the ranks' "
           "calls differ in what must agree (the recipe, the EPConfig, the dtypes and shapes)")  # on the device
_REFUSED_CODE = 1


class Disagreed(ValueError):
    """The ranks' calls differ, though each rank's was agreed before: raised on every rank at the exchange
    (distributed.ep then gathers the values once more and names them)."""


def signature(key) -> int:
    """A code for an agreed call's values (key: a tuple of their reprs), the same in every process; even, never 0
    or the refusal's code."""
    return (zlib.crc32(repr(key).encode()) << 1) | 2


def exchange(send: torch.Tensor, group, agreed: int = 0, refused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer call's first exchange: send (ep, ...) int64 to the ranks (row d to rank d), each row with this rank's
    code beside it (agreed: its call's signature, 0 for none; refused: the refusal's code); (what arrived, shaped as
    send; the stops (ep,) by source rank: 0 where its call agrees with this one's or either carries no signature, 1
    where it refused, 2 where it differs)."""
    ep = send.shape[0]
    both = torch.cat([send.reshape(ep, -1), send.new_full((ep, 1), _REFUSED_CODE if refused else agreed)], 1)
    got = torch.empty_like(both)
    dist.all_to_all_single(got, both, group=group)
    code = got[:, -1]
    # 0: a call that carries no signature (under torch.compile; its values were agreed in eager mode), on either
    # side: nothing to compare
    differ = (code != agreed) & (code != 0) if agreed else torch.zeros_like(code, dtype=torch.bool)
    stops = torch.where(code == _REFUSED_CODE, 1, differ.to(torch.int64) * 2)
    return got[:, :-1].reshape(send.shape), stops


def stop_if_any(stops: torch.Tensor) -> None:
    """The stops of exchange, read on the host: ValueError(REFUSED) where a rank refused, Disagreed where a rank's
    call differs; nothing where all agree."""
    if (stops == 1).any():
        raise ValueError(REFUSED)
    if stops.any():
        raise Disagreed(DIFFER)


def assert_none(stops: torch.Tensor) -> None:
    """The stops of exchange, checked on the device (no host sync): a device-side assert, which ends the program."""
    fail_if(stops.ne(0).any(), STOPPED)


def refuse(group, shape: tuple[int, ...], device) -> None:
    """A rank that refused its inputs: its side of the call's first exchange (send of `shape`, zeros, its code), so
    that the other ranks stop there with it."""
    exchange(torch.zeros(shape, dtype=torch.int64, device=device), group, refused=True)
