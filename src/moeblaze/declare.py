"""A differentiable op declared once: its tensor inputs, what its forward keeps for backward and its non-tensor
options as NamedTuples, its forward and backward bodies over those bundles, and the forward's fake. From that one
declaration come the torch.library custom-op pair moeblaze::{name}_fwd / _bwd (what torch.compile traces: schemas,
positional adapters, fakes, the autograd that joins them) and an autograd.Function over the same bodies (what eager
mode calls: the dispatcher costs ~50 µs of host time a step). A new input, kept tensor or option is one field.

Bundles: a field annotated `torch.Tensor` is a tensor argument, `torch.Tensor | None` (defaulting to None) an
optional one, a NamedTuple a nested bundle (its tensors in place, named `field_leaf` in the schemas), and a last
field `tuple[G, ...]` a group repeated any number of times (the schemas name one: the traced path has one; eager
calls may carry several). Options: `str`, `int`, `float`, `bool`, `int | None`. The backward's gradients are named by
tensor input fields; the others get None, as every option does. A gradient's fake has its input's layout (strides)
unless the field is named in `contiguous`.

Memory: nothing of its own; the forward's outputs past its results are what backward keeps (save_for_backward).
"""
from __future__ import annotations

import types
import typing
from collections.abc import Callable

import torch

_SCALARS = {str: "str", int: "int", float: "float", bool: "bool"}


def _is_bundle(t) -> bool:
    return isinstance(t, type) and issubclass(t, tuple) and hasattr(t, "_fields")


def _optional_of(hint):
    """X where hint is `X | None` (or Optional[X]), else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0]
    return None


class Layout:
    """A bundle's tensors in one flat order (the module header's rules): flatten, unflatten, and the schema's
    argument names."""

    def __init__(self, bundle: type, prefix: str = ""):
        if not _is_bundle(bundle):
            raise TypeError(f"{bundle!r} is not a NamedTuple")
        self.bundle = bundle
        self.fields: list[tuple[str, str, object]] = []  # (field, kind, sub-layout): tensor, optional, nested, repeated
        self.names: list[str] = []  # one instance's leaves, as the schemas name them
        self.optional: list[bool] = []
        hints = typing.get_type_hints(bundle)
        for i, f in enumerate(bundle._fields):
            hint, name = hints[f], prefix + f
            if hint is torch.Tensor:
                self._leaf(f, "tensor", name, False)
            elif _optional_of(hint) is torch.Tensor:
                if bundle._field_defaults.get(f, 0) is not None:
                    raise TypeError(f"{bundle.__name__}.{f}: an optional tensor defaults to None")
                self._leaf(f, "optional", name, True)
            elif _is_bundle(hint):
                self._nest(f, "nested", Layout(hint, name + "_"))
            elif typing.get_origin(hint) is tuple and typing.get_args(hint)[1:] == (Ellipsis,):
                if i != len(bundle._fields) - 1:
                    raise TypeError(f"{bundle.__name__}.{f}: a repeated group is the last field")
                self._nest(f, "repeated", Layout(typing.get_args(hint)[0], name + "_"))
            else:
                raise TypeError(f"{bundle.__name__}.{f}: {hint!r} is not a tensor, an optional tensor or a bundle")
        self.width = len(self.names)  # one instance's leaves
        self.repeated = bool(self.fields) and self.fields[-1][1] == "repeated"
        self.plain = all(kind in ("tensor", "optional") for _f, kind, _s in self.fields)  # the bundle is its leaves

    def _leaf(self, f: str, kind: str, name: str, optional: bool):
        self.fields.append((f, kind, None))
        self.names.append(name)
        self.optional.append(optional)

    def _nest(self, f: str, kind: str, sub: Layout):
        if sub.repeated:
            raise TypeError(f"{self.bundle.__name__}.{f}: a repeated group only at the top level, last")
        self.fields.append((f, kind, sub))
        self.names += sub.names
        self.optional += sub.optional

    def schema(self) -> list[str]:
        return [("Tensor? " if o else "Tensor ") + n for n, o in zip(self.names, self.optional)]

    def flatten(self, value) -> tuple:
        if self.plain:
            return tuple(value)
        out = []
        for (_f, kind, sub), v in zip(self.fields, value):
            if kind in ("tensor", "optional"):
                out.append(v)
            elif kind == "nested":
                out += sub.flatten(v)
            else:
                out += [t for group in v for t in sub.flatten(group)]
        return tuple(out)

    def unflatten(self, flat) -> tuple:
        """The bundle from exactly its flat tensors (a repeated group takes all that remain)."""
        if self.plain:
            return self.bundle._make(flat)  # TypeError for a wrong count
        value, i = [], 0
        for _f, kind, sub in self.fields:
            if kind in ("tensor", "optional"):
                value.append(flat[i])
                i += 1
            elif kind == "nested":
                value.append(sub.unflatten(flat[i:i + sub.width]))
                i += sub.width
            else:
                rest = flat[i:]
                if len(rest) % sub.width:
                    raise ValueError(f"{len(rest)} tensors are not whole {sub.bundle.__name__} groups")
                value.append(tuple(sub.unflatten(rest[j:j + sub.width]) for j in range(0, len(rest), sub.width)))
                i = len(flat)
        if i != len(flat):
            raise ValueError(f"{self.bundle.__name__} takes {i} tensors, got {len(flat)}")
        return self.bundle(*value)


def _options_schema(options: type) -> list[str]:
    out = []
    for f, hint in typing.get_type_hints(options).items():
        inner = _optional_of(hint)
        scalar = _SCALARS.get(inner if inner is not None else hint)
        if scalar is None:
            raise TypeError(f"{options.__name__}.{f}: {hint!r} is not str, int, float, bool or one of them | None")
        out.append(f"{scalar}{'?' if inner is not None else ''} {f}")
    return out


class Op:
    """A declared op (the module header): call it with its input and option bundles.

    Args:
        name: the custom ops' names, moeblaze::{name}_fwd and _bwd.
        inputs, kept, options: the bundles' NamedTuple types.
        results: the names of the forward's result tensors; the first is differentiable, the others are side
            outputs (never differentiated).
        grads: the tensor input fields the backward returns gradients for, in its order (an absent optional
            input's may be anything: it is answered None).
        forward: (inputs, options) -> (*results, kept).
        backward: (dout, inputs, kept, options) -> the gradients, in `grads`' order.
        forward_fake: as forward, on fake tensors (shapes, dtypes, layouts only).
        save: the inputs as backward keeps them (default: as given), e.g. an input backward never reads made empty.
        eager_backward: the autograd.Function's backward body, where it differs from `backward` (it may know what
            the custom op cannot, e.g. whether the graph is kept).
        contiguous: gradients whose fakes are contiguous rather than in their inputs' layout.
    """

    def __init__(self, name: str, *, inputs: type, kept: type, options: type, results: tuple[str, ...],
                 grads: tuple[str, ...], forward: Callable, backward: Callable, forward_fake: Callable,
                 save: Callable | None = None, eager_backward: Callable | None = None,
                 contiguous: tuple[str, ...] = ()):
        self.name, self.inputs, self.kept = name, Layout(inputs), Layout(kept)
        self.options, self.results, self.grads = options, results, grads
        self._forward, self._backward, self._save = forward, backward, save
        self._n_in, self._n_opt = self.inputs.width, len(options._fields)
        self._grad_slots = self._slots(grads)
        fwd_args, bwd_args = self._schemas()
        tensors = ", ".join(["Tensor"] * (len(results) + self.kept.width))
        self.fwd = torch.library.custom_op(f"moeblaze::{name}_fwd", self._forward_op, mutates_args=(),
                                           schema=f"({', '.join(fwd_args)}) -> ({tensors})")
        tensors = ", ".join(["Tensor"] * len(grads))
        self.bwd = torch.library.custom_op(f"moeblaze::{name}_bwd", self._backward_op, mutates_args=(),
                                           schema=f"({', '.join(bwd_args)}) -> ({tensors})")
        self.fwd.register_fake(lambda *args: self._flat_forward(forward_fake, args))
        like = {f: f not in contiguous for f in grads}
        self.bwd.register_fake(lambda dout, *args: self._grad_fakes(dout, args, like))
        self.fwd.register_autograd(self._autograd_backward(self.bwd), setup_context=self._setup_context)
        eager_body = self._backward_op if eager_backward is None else (
            lambda dout, *args: eager_backward(dout, *self._split_bwd(args)))
        self.eager = _eager_function(f"_Eager_{name}", self._forward_op, self._setup_context,
                                     self._autograd_backward(eager_body))

    def _slots(self, grads: tuple[str, ...]) -> tuple:
        """Each input leaf's gradient: its index in the backward's results, or None (nested leaves take none)."""
        if self.inputs.repeated:
            raise TypeError(f"{self.name}: the inputs have no repeated group (the options follow them)")
        slots, known = [], set()
        for f, kind, sub in self.inputs.fields:
            if kind in ("tensor", "optional"):
                known.add(f)
                slots.append(grads.index(f) if f in grads else None)
            else:
                slots += [None] * sub.width
        if set(grads) - known:
            raise TypeError(f"{self.name}: gradients of {sorted(set(grads) - known)}, which are not tensor inputs")
        return tuple(slots)

    def _schemas(self) -> tuple[list[str], list[str]]:
        """The forward's and the backward's arguments; TypeError where a name repeats."""
        opts = _options_schema(self.options)
        fwd_args = self.inputs.schema() + opts
        bwd_args = ["Tensor dout"] + self.inputs.schema() + self.kept.schema() + opts
        names = [a.split()[-1] for a in bwd_args]
        if len(set(names)) != len(names):
            raise TypeError(f"{self.name}: the schemas' names repeat: "
                            f"{sorted(n for n in set(names) if names.count(n) > 1)}")
        return fwd_args, bwd_args

    def __call__(self, inputs, options, traced: bool | None = None) -> tuple[torch.Tensor, ...]:
        """The results: through the custom op where traced (default: under torch.compile), else the eager
        Function."""
        args = (*self.inputs.flatten(inputs), *options)
        traced = torch.compiler.is_compiling() if traced is None else traced
        return (self.fwd(*args) if traced else self.eager.apply(*args))[:len(self.results)]

    # the adapters: flat arguments <-> bundles, in one place
    def _split_fwd(self, args: tuple):
        n = self._n_in
        return self.inputs.unflatten(args[:n]), self.options(*args[n:])

    def _split_bwd(self, args: tuple):
        n, m = self._n_in, len(args) - self._n_opt
        return self.inputs.unflatten(args[:n]), self.kept.unflatten(args[n:m]), self.options(*args[m:])

    def _flat_forward(self, body, args: tuple) -> tuple:
        *results, kept = body(*self._split_fwd(args))
        return (*results, *self.kept.flatten(kept))

    def _forward_op(self, *args):
        return self._flat_forward(self._forward, args)

    def _backward_op(self, dout, *args):
        return tuple(self._backward(dout, *self._split_bwd(args)))

    def _grad_fakes(self, dout, args: tuple, like: dict) -> tuple:
        inputs = self._split_bwd(args)[0]
        out = []
        for f in self.grads:
            t = getattr(inputs, f)
            out.append(dout.new_empty(0) if t is None else torch.empty_like(t) if like[f] else t.new_empty(t.shape))
        return tuple(out)

    def _setup_context(self, ctx, inputs, output):  # torch.library passes these by name
        n = self._n_in
        saved = inputs[:n] if self._save is None else self.inputs.flatten(self._save(self.inputs.unflatten(inputs[:n])))
        ctx.save_for_backward(*saved, *output[len(self.results):])
        ctx.options = inputs[n:]
        ctx.set_materialize_grads(False)  # kept state is never differentiated: no zero gradients made for it

    def _autograd_backward(self, body):
        n_args, slots = self._n_in + self._n_opt, self._grad_slots

        def backward(ctx, dout, *_side_outputs):
            if dout is None:  # the result took no part in the loss
                return (None,) * n_args
            saved = ctx.saved_tensors  # once: activation checkpointing unpacks each saved tensor once only
            results = body(dout.contiguous(), *saved, *ctx.options)
            grads = tuple(None if j is None or t is None else results[j] for j, t in zip(slots, saved))
            return (*grads, *(None,) * self._n_opt)
        return backward


def _eager_function(name: str, forward_body, setup_context, backward) -> type:
    """An autograd.Function over the op's bodies, context and backward, called directly (not through the
    dispatcher). Its first output is the result; the others are side outputs and kept state."""

    def forward(ctx, *inputs):
        output = forward_body(*inputs)
        setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(*output[1:])
        return output

    return type(name, (torch.autograd.Function,), dict(forward=staticmethod(forward), backward=staticmethod(backward)))

