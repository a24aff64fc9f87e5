"""An expert-parallel transport's custom-op pair from its parts (what distributed.pairs and distributed.tokens
share): the transport names its tensor inputs (a NamedTuple whose first fields are x, topk_w, w1, w2 and whose
field w1_up is optional), what its forward keeps (a NamedTuple with flat() and of()), its forward and backward
bodies, their fakes and the non-tensor tail of its forward; this derives the schemas, the positional adapters, the
context saving and the gradients' mapping (experts.op.define_op_pair builds the ops, their autograd and the eager
Function), and the entry that runs it traced (capacity dispatch under torch.compile) or eagerly.

Memory: nothing of its own; the forward's outputs past (out, needed) are what backward keeps.
"""
from __future__ import annotations

import torch

from ..experts.op import define_op_pair, op_schema


def define_ep_op(name: str, bundle: type, kept_fields: tuple[str, ...], kept: type, forward, backward, *,
                 tail: str, fwd_fake, bwd_fake):
    """The pair moeblaze::{name}_fwd / _bwd. forward(inputs, *tail) -> (out, needed, kept); backward(dout, inputs,
    kept, group_name, key) -> (dx, dtopk_w, dw1, dw2, dw1_up (empty without w1_up)); the fakes take the ops'
    flat arguments. bundle: the tensor inputs' NamedTuple; kept_fields: kept's flat tensors' names (the schemas');
    tail's first two arguments are group_name and key (what backward takes)."""
    n = len(bundle._fields)

    def forward_op(*args):
        out, needed, saved = forward(bundle(*args[:n]), *args[n:])
        return (out, needed, *saved.flat())

    def backward_op(dout, *args):
        return backward(dout, bundle(*args[:n]), kept.of(args[n:-2]), *args[-2:])

    def setup_context(ctx, inputs, output):  # torch.library passes these by name
        ctx.save_for_backward(*inputs[:n], *output[2:])
        ctx.tail = inputs[n:n + 2]  # group_name, key
        ctx.set_materialize_grads(False)

    def grads(saved: tuple, results: tuple):
        dx, dtopk_w, dw1, dw2, dw1_up = results
        split = bundle(*saved[:n]).w1_up is not None  # W1 came in two parts
        given = dict(x=dx, topk_w=dtopk_w, w1=dw1, w2=dw2, w1_up=dw1_up if split else None)
        return bundle(**{f: given.get(f) for f in bundle._fields})

    return define_op_pair(name, forward_op, backward_op,
                          fwd_schema=op_schema(bundle, tail=tail, returns=2 + len(kept_fields)),
                          bwd_schema=op_schema("dout", bundle, *kept_fields, tail="str group_name, str key",
                                               returns=5),
                          setup_context=setup_context, grads=grads, fwd_fake=fwd_fake, bwd_fake=bwd_fake)


def run_ep_op(pair, args: tuple, capacity: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, needed): capacity dispatch traced whole under torch.compile (fixed shapes); otherwise eagerly (exact
    dispatch reads its row counts on the host)."""
    traced = capacity is not None and torch.compiler.is_compiling()
    return (pair.fwd(*args) if traced else pair.eager.apply(*args))[:2]


def grad_fakes(inputs: type):
    """The backward's fake: gradients shaped as x, topk_w, w1, w2 and w1_up (empty where W1 is one tensor)."""
    n = len(inputs._fields)

    def fake(dout, *args):
        i = inputs(*args[:n])
        return (i.x.new_empty(i.x.shape), i.topk_w.new_empty(i.topk_w.shape), torch.empty_like(i.w1),
                torch.empty_like(i.w2), i.x.new_empty(0) if i.w1_up is None else torch.empty_like(i.w1_up))
    return fake
