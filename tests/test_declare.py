"""An op declared once (moeblaze.declare): a toy op with a nested input bundle, an optional input, a repeated kept
group and typed options gets its schemas, fakes and autograd derived, eagerly and under torch.compile, with
gradients equal to torch's; malformed declarations are refused by name."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from moeblaze.declare import Layout, Op


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class Inputs(NamedTuple):
    x: torch.Tensor
    pair: Pair  # not differentiated
    w: torch.Tensor | None = None


class Saved(NamedTuple):
    x_scaled: torch.Tensor


class Kept(NamedTuple):
    total: torch.Tensor
    parts: tuple[Saved, ...]


class Options(NamedTuple):
    scale: float
    parts: int
    note: str
    cap: int | None


def _forward(i: Inputs, o: Options):
    """out = scale · x · (a + b) (· w), the sum as a side output; kept: x·scale in `parts` pieces."""
    factor = (i.pair.a + i.pair.b) * (1 if i.w is None else i.w)
    out = o.scale * i.x * factor
    pieces = tuple(Saved(c * o.scale) for c in i.x.chunk(o.parts))
    return out, out.sum().reshape(1), Kept(factor, pieces)


def _backward(dout, i: Inputs, kept: Kept, o: Options):
    x_scaled = torch.cat([s.x_scaled for s in kept.parts])
    dx = dout * o.scale * kept.total
    dw = dout * x_scaled * (i.pair.a + i.pair.b) if i.w is not None else dout.new_empty(0)
    return dx, dw


def _fake(i: Inputs, o: Options):
    return (torch.empty_like(i.x), i.x.new_empty(1),
            Kept(torch.empty_like(i.x), (Saved(torch.empty_like(i.x)),)))


TOY = Op("toy_declared", inputs=Inputs, kept=Kept, options=Options, results=("out", "total"), grads=("x", "w"),
         forward=_forward, backward=_backward, forward_fake=_fake)


def test_schemas_derive_from_the_bundles():
    assert str(TOY.fwd._opoverload._schema) == (
        "moeblaze::toy_declared_fwd(Tensor x, Tensor pair_a, Tensor pair_b, Tensor? w, float scale, int parts, "
        "str note, int? cap) -> (Tensor, Tensor, Tensor, Tensor)")
    assert str(TOY.bwd._opoverload._schema).startswith(
        "moeblaze::toy_declared_bwd(Tensor dout, Tensor x, Tensor pair_a, Tensor pair_b, Tensor? w, Tensor total, "
        "Tensor parts_x_scaled, float scale")


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "custom_op"])
@pytest.mark.parametrize("with_w", [False, True])
def test_gradients_equal_torchs(traced, with_w):
    g = torch.Generator().manual_seed(0)
    x, a, b, w = (torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(4))
    parts = 1 if traced else 3  # several kept groups eagerly; the traced op has one
    opts = Options(0.5, parts, "n", None)

    def run(x, w):
        return TOY(Inputs(x, Pair(a, b), w if with_w else None), opts, traced=traced)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out, total = run(xs, ws)
    assert traced or not total.requires_grad  # eagerly a side output is marked non-differentiable
    dy = torch.randn(6, 4, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, [xs, ws] if with_w else [xs], dy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = 0.5 * xr * ((a + b) * (wr if with_w else 1))  # the op's order of operations: the same bits
    want = torch.autograd.grad(ref, [xr, wr] if with_w else [xr], dy)
    assert torch.equal(out.detach(), ref.detach())
    for g1, g2 in zip(got, want):
        torch.testing.assert_close(g1, g2, rtol=0, atol=0)


def test_compiles_whole():
    x, a, b, w = (torch.randn(6, 4) for _ in range(4))

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(x, w):
        return TOY(Inputs(x, Pair(a, b), w), Options(2.0, 1, "n", 3))[0].sum()
    xs = x.clone().requires_grad_()
    f(xs, w).backward()
    torch.testing.assert_close(xs.grad, 2.0 * (a + b) * w, rtol=0, atol=0)


def test_malformed_declarations_are_refused():
    class Loose(NamedTuple):
        x: torch.Tensor
        n: int
    with pytest.raises(TypeError, match="Loose.n"):
        Layout(Loose)

    class Middle(NamedTuple):
        parts: tuple[Saved, ...]
        x: torch.Tensor
    with pytest.raises(TypeError, match="last field"):
        Layout(Middle)

    class Opts(NamedTuple):
        shape: list
    with pytest.raises(TypeError, match="Opts.shape"):
        Op("toy_bad_options", inputs=Inputs, kept=Kept, options=Opts, results=("out",), grads=("x",),
           forward=_forward, backward=_backward, forward_fake=_fake)
    with pytest.raises(TypeError, match="pair"):
        Op("toy_bad_grads", inputs=Inputs, kept=Kept, options=Options, results=("out",), grads=("pair",),
           forward=_forward, backward=_backward, forward_fake=_fake)

    class Clash(NamedTuple):
        x: torch.Tensor
    with pytest.raises(TypeError, match="repeat"):
        Op("toy_clash", inputs=Inputs, kept=Clash, options=Options, results=("out",), grads=("x",),
           forward=_forward, backward=_backward, forward_fake=_fake)
