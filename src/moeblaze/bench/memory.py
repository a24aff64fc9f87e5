"""Counting what autograd keeps for backward: every tensor packed by torch.autograd.graph's
saved_tensors_hooks, each storage counted once, attributed to the module and the op that saved it."""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.overrides import TorchFunctionMode


class _OpTracker(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.current = "?"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None) or str(func)
        if name in ("__get__", "__set__"):  # attribute access, not an op
            return func(*args, **(kwargs or {}))
        name = name.strip("_")
        outer, self.current = self.current, name
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = outer


class SavedTensorCounter:
    """Context manager. `exclude` tensors (inputs, parameters) are listed apart: they exist anyway.
    After exit: `.rows` [(where, count, bytes)], `.total_bytes` (excluding `exclude`)."""

    def __init__(self, root: torch.nn.Module | None = None, exclude=()):
        self.names = {m: n or type(root).__name__ for n, m in root.named_modules()} if root is not None else {}
        self.excluded = {self._key(t) for t in exclude}
        self.seen: dict = {}
        self.module_stack: list[str] = []

    @staticmethod
    def _key(t: torch.Tensor):
        return (t.device, t.untyped_storage().data_ptr())

    def _pack(self, t: torch.Tensor):
        key = self._key(t)
        if key not in self.seen and key not in self.excluded and t.untyped_storage().nbytes() > 0:
            mod = self.module_stack[-1] if self.module_stack else "(functional)"
            self.seen[key] = (f"{mod}:{self.ops.current}", t.untyped_storage().nbytes())
        return t

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self.ops = _OpTracker()

        def enter(module, args):
            self.module_stack.append(self.names.get(module, type(module).__name__))

        def leave(module, args, output):  # returns None: a forward hook's return value replaces the output
            self.module_stack.pop()

        self.hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
        self.saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.saved.__enter__()
        self.ops.__enter__()
        return self

    def __exit__(self, *exc):
        self.ops.__exit__(*exc)
        self.saved.__exit__(*exc)
        for h in self.hooks:
            h.remove()
        return False

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.seen.values())

    @property
    def rows(self):
        agg = defaultdict(lambda: [0, 0])
        for where, b in self.seen.values():
            agg[where][0] += 1
            agg[where][1] += b
        return sorted(((w, c, b) for w, (c, b) in agg.items()), key=lambda r: -r[2])
