"""The experts op's kernel backends by name: each one object (KernelBackend) with the same stage signatures and,
beside its kernels, a `takes_<stage>` check with the stage's own arguments. experts.dispatch walks this registry:
a launch runs on the backend a call resolved to where that backend takes its operands, on tl otherwise (tl, the
portable Triton kernels, takes every launch: the universal fallback). A new backend is one package exporting one
such object and one line below (or `register(obj)` from outside the package; docs/extending.md).

Memory: none (a dict of a few entries).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ..configs.experts import add_launch_backend

if TYPE_CHECKING:
    from .schedule import RowPlan

STAGES = ("up", "down", "dx_rows", "down_bwd", "weight_grad", "fp8_rows")  # each one launch (down_bwd: up to two)


class KernelBackend(Protocol):
    """A set of kernels for the stages (experts.stages has their maths); every stage returns what the tl one does.

    name: what ExpertsConfig.backend calls it. needs: what it runs on, for a refusal ("an sm_90 GPU ...").
    available(device): whether it can run there; preferred(device): whether backend="auto" picks it there (the
    first registered backend that prefers a device wins; tl where none does). takes_<stage>(*the stage's
    arguments): whether this launch's operands suit it (dtypes, strides, alignment, widths); it falls back to tl
    where not, so a shape never raises."""
    name: str
    needs: str

    def available(self, device: torch.device) -> bool: ...

    def preferred(self, device: torch.device) -> bool: ...

    def up(self, plan: RowPlan, x_LD, w1_EFD, activation: str, store_preact: bool, store_act: bool, *, b1_EF,
           interleaved: bool, w1_up) -> tuple[torch.Tensor, torch.Tensor]:
        """(preact (R, F), act (R, H)), an empty tensor for one not stored (stages.up)."""

    def down(self, plan: RowPlan, act_RH, w2_EDH) -> torch.Tensor:
        """Y (R, D) (stages.down)."""

    def dx_rows(self, plan: RowPlan, dpreact_RF, w1_EFD, *, w1_up) -> torch.Tensor:
        """dX~ (R, D) (stages.dx_rows)."""

    def down_bwd(self, plan: RowPlan, dy_LD, w2_EDH, preact_RF, topk_w_LK, dpreact_RF, activation: str, *,
                 interleaved: bool, preact_scale) -> tuple[torch.Tensor, torch.Tensor]:
        """(s·A, dS), dH into dpreact_RF (stages.down_bwd)."""

    def weight_grad(self, plan: RowPlan, p, q, out, gather_p: bool, *, out_up) -> torch.Tensor:
        """dW into out (and out_up), returns out (stages.weight_grad)."""

    def fp8_rows(self, plan: RowPlan, a_q: tuple, w_q: tuple, out_dtype: torch.dtype, token) -> torch.Tensor:
        """C = q(A)[token or rows] · q(W[e])ᵀ on e4m3 with block scales (experts.fp8)."""


_REGISTRY: dict[str, KernelBackend] = {}
_LISTENERS: list = []  # called after each registration (experts.dispatch's cached resolution)


def on_register(listener) -> None:
    _LISTENERS.append(listener)


def register(backend: KernelBackend) -> KernelBackend:
    """Add a backend (or replace one of its name); it becomes a choice of ExpertsConfig.backend. TypeError where a
    stage or its check is missing."""
    missing = [m for s in STAGES for m in (s, f"takes_{s}") if not callable(getattr(backend, m, None))]
    missing += [m for m in ("available", "preferred") if not callable(getattr(backend, m, None))]
    if missing or not isinstance(getattr(backend, "name", None), str):
        raise TypeError(f"a kernel backend needs a name and {', '.join(missing) or 'every stage'}")
    _REGISTRY[backend.name] = backend
    add_launch_backend(backend.name)
    for listener in _LISTENERS:
        listener()
    return backend


def get(name: str) -> KernelBackend:
    return _REGISTRY[name]


def auto(device: torch.device) -> str:
    """The backend backend="auto" runs on device: the first one registered after tl that prefers it, else tl."""
    return next((b.name for b in _REGISTRY.values() if b.name != "tl" and b.preferred(device)), "tl")


def _builtin():
    from .gluon_sm90.backend import GLUON
    from .tl.backend import TL
    register(TL)  # first: the fallback of every launch
    register(GLUON)


_builtin()
