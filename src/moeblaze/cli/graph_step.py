"""One training step (forward, loss, backward, gradient clipping) captured in a CUDA graph and replayed.

A small model's step is paced by the host: each of its few hundred launches, FSDP2's hooks and its collectives
cost the CPU more than the GPU takes to run them. Replayed, the step is one graph launch; the optimizer stays
eager (its learning rate changes every step) and runs on the gradients the graph writes.

    step = GraphedStep(lambda x, y: train_step(x, y) + (clip(),))
    loss, aux, total, norm = step(x, y)       # first call: eager (it also warms up); second: capture; then replay

The step must hold still: the same shapes every call, no host syncs and no Python state that changes between
steps (it would be frozen at its value at capture). The model's parameters must keep their storage (optimizers
update in place) and nothing but the graph may set their .grad to None after the capture: the gradients the graph
writes are the ones the capture bound to .grad. Torch's recipe: the step is warmed up and captured on one side
stream, whose work the caller's stream then waits for.

Memory: the graph's private pool keeps the step's activations, gradients and the inputs' copies for the whole run
(what the eager step allocates at its peak, held); nothing else.
"""
from __future__ import annotations

import torch

from . import UsageError


class GraphedStep:
    """fn(*inputs) -> tuple of tensors, run eagerly on the first call, captured on the second and replayed after
    (each call copies its inputs into the captured ones; the returned tensors are fresh copies, safe to keep)."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.stream = torch.cuda.Stream()
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.outputs: tuple[torch.Tensor, ...] = ()

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.calls += 1
        if self.graph is not None:
            self._check(inputs)
            for static, new in zip(self.inputs, inputs):
                static.copy_(new)
            self.graph.replay()
            return tuple(t.clone() for t in self.outputs)
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            if self.calls == 1:  # eager: a real step, and the warm-up (autotuning, lazy state, communicators)
                out = tuple(t.clone() for t in self.fn(*inputs))
            else:  # kept only once the capture has succeeded: a failed one raises and leaves nothing to replay
                static, graph = tuple(t.clone() for t in inputs), torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                    outputs = tuple(self.fn(*static))
                self.graph, self.inputs, self.outputs = graph, static, outputs
                graph.replay()  # the capture ran nothing: this is the step
                out = tuple(t.clone() for t in outputs)
        caller.wait_stream(self.stream)
        return out

    def _check(self, inputs) -> None:
        for i, (static, new) in enumerate(zip(self.inputs, inputs, strict=True)):
            if static.shape != new.shape or static.dtype != new.dtype:
                raise ValueError(f"a CUDA-graphed step's input {i} was captured as {tuple(static.shape)} "
                                 f"{static.dtype}, got {tuple(new.shape)} {new.dtype}: every step must have the "
                                 "same shapes")


def check_graphable(config) -> None:
    """UsageError unless --cuda-graph can capture the step this run makes: a GPU, and nothing in the step that
    reads the device from the host or keeps Python state across steps."""
    par, machine = config.parallel, config.machine
    if par.ep > 1 and par.ep_config.dispatch == "exact":
        raise UsageError("--cuda-graph: --ep-dispatch exact reads each layer's split sizes on the host every step; "
                         "use --ep-dispatch capacity with --on-overflow drop")
    if par.ep > 1 and par.on_overflow in ("rerun", "error"):
        raise UsageError(f"--cuda-graph: --on-overflow {par.on_overflow} reads the overflow flag on the host every "
                         "step; use --on-overflow drop (the dropped rows counted and reported)")
    if config.model.experts.fp8_weight_cache:
        raise UsageError("--cuda-graph: --fp8-weight-cache decides on the host, once a step, whether the weights "
                         "changed; leave it off (the graph quantizes them every step)")
    if machine.compile:
        raise UsageError("--cuda-graph with --compile is not supported yet: use one of them")
    if machine.device != "cuda":
        raise UsageError("--cuda-graph needs --device cuda")
