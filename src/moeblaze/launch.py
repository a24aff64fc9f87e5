"""A lighter launch path for the kernels a training step launches every step, on the host side only.

Triton's `kernel[grid](...)` binds and specializes every argument, hashes the result and looks the compiled
kernel up before it launches: ~40 µs of host time per launch on an H200's host, against ~13 µs for the
launch itself. A layer step issues a dozen launches, so at small token counts the host, not the GPU, would
set the pace. `launch` keys the compiled kernel by a tuple that is at least as fine as Triton's own
specialization (the kernel, the device, every constexpr and option, each tensor's dtype and 16-byte
alignment, every other argument's exact value, each tensor descriptor's dtype, alignment, shape, strides,
block and layout) and launches the cached kernel directly. A key it has not seen goes through Triton's
own path, which compiles if needed and launches; the kernel it returns is cached for the next call. Under
the interpreter, under torch.compile's tracing, or with launch hooks installed (profilers), every call
takes Triton's path.

Tensor descriptors are encoded on the host at launch, which needs the thread's CUDA context current. The
autograd engine runs backward on a thread of its own where none may be current yet (PyTorch issue
124565); `ensure_context` makes it current once per thread, through a runtime call that never blocks.

Memory contract: one cached handle per (kernel, key), at most MAX_KEYS of them (scalars such as the token
count are part of the key, so a run with ever-changing sizes starts the cache over); nothing per call.
"""
from __future__ import annotations

import functools
import inspect
import threading

import torch
from triton import knobs

from .env import INTERPRET

MAX_KEYS = 4096
_CACHE: dict = {}
_PARAMS: dict = {}
_THREAD = threading.local()


def ensure_context(device: int) -> None:
    """Make the CUDA context of `device` current on this thread (once per thread and device)."""
    bound = getattr(_THREAD, "devices", None)
    if bound is None:
        bound = _THREAD.devices = set()
    if device not in bound:
        torch.cuda.current_stream(device).query()  # cudaStreamQuery: binds the primary context, never waits
        bound.add(device)


def cached_kernels() -> int:
    """Compiled kernels the launch path holds (one per key it has seen since the cache last started over)."""
    return len(_CACHE)


def tma_ok(t) -> bool:
    """A row-major 2D tensor a tensor descriptor can address (16-byte aligned base and row stride)."""
    return (t is not None and t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host integers (triton.cdiv is a jit helper: about 2 µs a call from Python)."""
    return -(-a // b)


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (persistent grids launch one program each); 4 elsewhere (the
    interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _hooked(hook) -> bool:
    """Whether a launch hook is installed (a HookChain with calls on triton 3.6+, a callable before)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def arg_key(a):
    """The part of the cache key one launch argument contributes."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor):  # a host tensor descriptor (tl or Gluon)
        return (base.dtype, base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides), tuple(a.block_shape),
                getattr(a, "layout", None), getattr(a, "padding", None))
    return type(a), a  # ints by exact value (Triton specializes on == 1 and % 16), bools, floats, None


def _params(fn) -> tuple:
    """The kernel's parameter names and defaults, in order."""
    p = _PARAMS.get(fn)
    if p is None:
        sig = inspect.signature(fn.fn)
        p = _PARAMS[fn] = tuple((name, par.default) for name, par in sig.parameters.items())
    return p


def launch(fn, grid: tuple, *args, **kwargs) -> None:
    """fn[grid](*args, **kwargs) for a @triton.jit / @gluon.jit kernel (not an autotuned one): positional
    runtime arguments, then constexprs and options (num_warps, maxnreg, ...) by keyword."""
    if INTERPRET or torch.compiler.is_compiling():  # torch.compile traces Triton's launch itself
        fn[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    ensure_context(device)
    if _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        fn[grid](*args, **kwargs)
        return
    key = (id(fn), device, tuple(kwargs.items()), *map(arg_key, args))
    hit = _CACHE.get(key)
    if hit is None:
        kernel = fn[grid](*args, **kwargs)
        params = _params(fn)[len(args):]
        missing = [name for name, default in params if name not in kwargs and default is inspect.Parameter.empty]
        if missing:
            raise TypeError(f"{fn.fn.__name__}: launch needs every parameter; missing {missing}")
        tail = tuple(kwargs.get(name, default) for name, default in params)
        if len(_CACHE) >= MAX_KEYS:
            _CACHE.clear()
        _CACHE[key] = (kernel, tail)
        return
    kernel, tail = hit
    g = tuple(grid) + (1, 1)
    kernel.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), kernel.function,
               kernel.packed_metadata, None, None, None, *args, *tail)
