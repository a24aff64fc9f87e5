"""The experts' parameters of Megatron's SequentialMLP (each expert's apart) as the op's (E, ...) operands, and their
gradients back into Megatron's gradient buffer.

Operands: each kind (fc1's weights, fc2's, each bias) laid out back to back in one storage is read there in place
(_InPlace); laid out otherwise (Megatron's distributed optimizer's buffer, last first) it is stacked per call
(_stack) and saved for backward as a recipe (_restacked: saved-tensor hooks restack it there).

Gradients: Megatron's DistributedDataParallel gives each parameter a `main_grad`, a view of its gradient buffer
(float32 under grad_reduce_in_fp32), and a hook that adds the parameter's gradient into it after backward, unless
the layer did so itself and set `grad_added_to_main_grad` (Megatron's gradient-accumulation-fusion protocol; DDP
clears the flag in zero_grad_buffer). Its buffer lays the parameters out last first, so one kind of 128 experts
sits at a fixed distance from expert to expert (negative: expert e + 1 below expert e). Where it does, both
operands' backward adds the (E, ...) gradient of that kind into all of them in one kernel and marks them added, in
place of the hook's one add per parameter (256 launches for 128 experts' two weights); elsewhere the hook adds
them. The sums are the hook's (main_grad += the gradient, in float32), bit for bit.

Memory: nothing of the weights' size outlives forward (stacks are rebuilt in backward); the gradients handed back
to autograd are views of the op's (E, ...) gradient, which the hook drops.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch
import triton
import triton.language as tl

from ..env import INTERPRET
from ..launch import cdiv, launch

BLOCK = 2048


@triton.jit
def _add_into(dst_ptr, src_ptr, n, dst_step, BLOCK: tl.constexpr):
    """dst[e] += src[e] over the n elements of expert e: dst[e] at dst_ptr + e·dst_step (any sign), src (E, n)."""
    e = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dst = dst_ptr + e * dst_step + offs
    total = tl.load(dst, mask=mask).to(tl.float32) + tl.load(src_ptr + e * n + offs, mask=mask).to(tl.float32)
    tl.store(dst, total.to(dst_ptr.dtype.element_ty), mask=mask)


def _step(params, grad: torch.Tensor) -> int | None:
    """The distance in elements from one expert's main_grad to the next, where every parameter takes part in the
    protocol and their main_grads sit that far apart, alike (shape, dtype, device, contiguous); else None. Checked
    in full once per set of main_grad tensors (DDP makes them once), then known by their identity (~70 us a call
    for 128 experts against ~1 ms for the full check, this CPU)."""
    mains = [getattr(p, "main_grad", None) for p in params]
    known = _STEPS.get(id(params[0]))
    if (known is not None and known[0]() is params[0] and len(known[1]) == len(mains)
            and all(r() is m for r, m in zip(known[1], mains))):
        return known[2] if grad.is_contiguous() and grad.shape[1:] == mains[0].shape else None
    step = _full_step(params, mains, grad)
    if all(m is not None for m in mains) and grad.is_contiguous():  # the verdict, either way, is the main_grads'
        key = id(params[0])
        first = weakref.ref(params[0], lambda ref: _STEPS.pop(key) if _STEPS.get(key, (None,))[0] is ref else None)
        _STEPS[key] = (first, tuple(weakref.ref(m) for m in mains), step)
    return step


def _full_step(params, mains, grad: torch.Tensor) -> int | None:
    if any(m is None for m in mains) or not grad.is_contiguous() or not all(
            hasattr(p, "grad_added_to_main_grad") and not getattr(p, "zero_out_wgrad", False) for p in params):
        return None
    first = mains[0]
    if not all(m.shape == first.shape == grad.shape[1:] and m.dtype == first.dtype and m.device == grad.device
               and m.is_contiguous() for m in mains):
        return None
    if len(mains) == 1:
        return 0
    step, size = mains[1].data_ptr() - first.data_ptr(), first.element_size()
    if step % size or abs(step) < first.numel() * size:  # overlapping slices would race
        return None
    if not all(m.data_ptr() == first.data_ptr() + i * step for i, m in enumerate(mains)):
        return None
    return step // size


_STEPS: dict = {}  # id of a kind's first parameter -> (it, its kind's main_grads, weakly; their step)


def add_into_main_grads(params, grad: torch.Tensor) -> bool:
    """grad (E, ...), the gradient of the E parameters `params` of one kind, added into their main_grads in one
    launch and each marked grad_added_to_main_grad, where _step finds them laid out for it (True); else each
    parameter's flag cleared, so that its hook adds it (False)."""
    step = _step(params, grad)
    if step is None or not (grad.is_cuda or INTERPRET):
        for p in params:
            if getattr(p, "grad_added_to_main_grad", False):
                p.grad_added_to_main_grad = False
        return False
    E, n = grad.shape[0], grad[0].numel()
    if n:
        launch(_add_into, (E, cdiv(n, BLOCK)), params[0].main_grad, grad, n, step, BLOCK=BLOCK)
    for p in params:
        p.grad_added_to_main_grad = True
    return True


def _joined(parts: tuple) -> bool:
    """Whether the parts are contiguous views of one storage, back to back in order: (E, ...) without a copy."""
    first, step = parts[0], parts[0].numel() * parts[0].element_size()
    return all(p.is_contiguous() and p.dtype == first.dtype and p.shape == first.shape and p.data_ptr() ==
               first.data_ptr() + i * step and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for i, p in enumerate(parts))


def _join(parts: tuple) -> None:
    """The parameters `parts` moved into one new storage, back to back in order (values unchanged)."""
    with torch.no_grad():
        whole = torch.stack([p.detach() for p in parts])
        for p, view in zip(parts, whole):
            p.data = view


class _InPlace(torch.autograd.Function):
    """Joined parts as the one (E, ...) tensor over their storage; the gradient splits back into each part, and
    into their main_grads where add_into_main_grads can."""

    @staticmethod
    def forward(ctx, *parts):
        ctx.parts = parts
        first = parts[0]
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (len(parts), *first.shape),
                                       (first.numel(), *first.stride()))

    @staticmethod
    def backward(ctx, grad):
        add_into_main_grads(ctx.parts, grad)
        return grad.unbind(0)


class _Stacked(_InPlace):
    """The parts as one (E, ...) copy (torch.stack); backward as _InPlace's."""

    @staticmethod
    def forward(ctx, *parts):
        ctx.parts = parts
        return torch.stack(parts)


def _stack(parts: tuple) -> torch.Tensor:
    """The experts' parameters as one operand (E, ...), a copy, differentiable in each part."""
    return _Stacked.apply(*parts)


@contextlib.contextmanager
def _restacked(stacks: dict):
    """Saved-tensor hooks under which a tensor sharing storage with one of `stacks` ({stacked tensor: the
    parameters it stacks}) is saved as the parameters and a view, and restacked where backward reads it. The hooks
    hold no stacked tensor (autograd keeps them with what they saved, until backward): storages by address."""
    storages = {s.untyped_storage().data_ptr(): (s.untyped_storage().nbytes(), parts, s.dtype)
                for s, parts in stacks.items()}

    def pack(t):
        hit = storages.get(t.untyped_storage().data_ptr())
        if hit is None or t.untyped_storage().nbytes() != hit[0]:
            return t
        return _Recipe(hit[1], t.size(), t.stride(), t.storage_offset(), hit[2])

    def unpack(p):
        return p.restack() if isinstance(p, _Recipe) else p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@dataclasses.dataclass(frozen=True)
class _Recipe:
    parts: tuple
    size: torch.Size
    stride: tuple
    offset: int
    dtype: torch.dtype

    def restack(self) -> torch.Tensor:
        with torch.no_grad():
            whole = torch.stack([p.to(self.dtype) for p in self.parts])
        return whole.as_strided(self.size, self.stride, self.offset)
