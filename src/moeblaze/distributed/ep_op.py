"""An expert-parallel transport's op (what distributed.pairs and distributed.tokens share): the options every
transport takes, and the op declared from the transport's bundles and bodies (moeblaze.declare derives the
custom-op pair, its schemas, adapters, saved state, gradients and the eager Function). Its inputs' first fields
are x, topk_w, w1 and w2, and w1_up is optional; its forward returns (out, needed, kept), its backward the
gradients of x, topk_w, w1, w2 and w1_up.

Memory: nothing of its own; what the forward keeps is the transport's (its module header).
"""
from __future__ import annotations

from typing import NamedTuple
from collections.abc import Callable

import torch

from ..declare import Op


class EPOptions(NamedTuple):
    """A transport op's non-tensor options: the process group by name, the experts op's key (experts.op.OpKey),
    capacity dispatch's rows per (source, destination) pair (None: exact dispatch), whether an overflow raises, the
    parts the transport pipelines, the dtype rows cross in (EPConfig.wire) and the signature of what the ranks agreed
    on (stops.exchange)."""
    group_name: str
    key: str
    capacity: int | None
    fail_on_overflow: bool
    chunks: int
    wire: str = "native"
    agreed: int = 0


def declare_ep_op(name: str, inputs: type, kept: type, forward: Callable, backward: Callable,
                  forward_fake: Callable) -> Op:
    """The pair moeblaze::{name}_fwd / _bwd. forward(inputs, options) -> (out, needed, kept); backward(dout, inputs,
    kept, options) -> (dx, dtopk_w, dw1, dw2, dw1_up (anything without w1_up))."""
    return Op(name, inputs=inputs, kept=kept, options=EPOptions, results=("out", "needed"),
              grads=("x", "topk_w", "w1", "w2", "w1_up"), forward=forward, backward=backward,
              forward_fake=forward_fake, contiguous=("x", "topk_w"))


def run_ep_op(op: Op, inputs, call) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, needed) of a transport's op on its inputs, with the options of an EPCall (distributed.transports):
    capacity dispatch traced whole under torch.compile (fixed shapes); otherwise eagerly (exact dispatch reads its
    row counts on the host)."""
    options = EPOptions(call.group_name, call.key, call.capacity, call.fail_on_overflow, call.chunks, call.wire,
                        call.agreed)
    return op(inputs, options, traced=call.capacity is not None and torch.compiler.is_compiling())
