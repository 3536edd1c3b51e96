"""CUDA graphs that replay only at the shapes they were captured for.

``StaticGraph`` owns static input buffers of fixed shape and dtype. A call copies
its arguments into them (host arguments through the graph's own pinned staging
buffers, so a step allocates no pinned memory and its uploads never block) and
replays; an argument of any other shape or dtype is refused with ``ShapeMismatch``
(a silent replay at another shape would read stale buffers and break
losslessness). Without CUDA (or with capture=False) the same object runs the
function eagerly over the same buffers, so the checks and the data flow are
tested on the CPU too; a capture that fails on the GPU falls back to that eager
path with a warning.
"""

from __future__ import annotations

from collections.abc import Callable

import logging

import torch

log = logging.getLogger("treespec.cuda_graph")


class ShapeMismatch(ValueError):
    """A replay was asked for at a shape or dtype the graph was not captured for."""


class StaticGraph:
    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]],
                 example: list[torch.Tensor], capture: bool = True,
                 pool: object | None = None, warmup: int = 2) -> None:
        self.fn = fn
        self.inputs = [t.clone() for t in example]
        self.signature = [(tuple(t.shape), t.dtype, t.device) for t in example]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        on_gpu = bool(example) and example[0].device.type == "cuda"
        self._stage: list[torch.Tensor | None] = [None] * len(example)   # made on first use
        self._uploaded = torch.cuda.Event() if on_gpu else None
        if capture and on_gpu:
            try:
                self._capture(pool, warmup)
            except Exception as e:   # a fallback, not a fake: the same fn, run eagerly
                log.warning("CUDA graph capture failed (%s: %s); running eagerly",
                            type(e).__name__, e)
                torch.cuda.synchronize()
                self.graph = None

    def _capture(self, pool: object | None, warmup: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):          # compiles Triton kernels, warms allocators
                self.fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = self.fn(*self.inputs)

    @property
    def pool(self) -> object | None:
        return self.graph.pool() if self.graph is not None else None

    def check(self, args: tuple[torch.Tensor, ...]) -> None:
        if len(args) != len(self.signature):
            raise ShapeMismatch(f"graph takes {len(self.signature)} inputs, got {len(args)}")
        for i, (a, (shape, dtype, _)) in enumerate(zip(args, self.signature)):
            if tuple(a.shape) != shape or a.dtype != dtype:
                raise ShapeMismatch(f"input {i} is {tuple(a.shape)} {a.dtype}; this graph "
                                    f"was captured for {shape} {dtype}")

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Replay on args; the returned tensors are overwritten by the next call."""
        self.check(args)
        if self._uploaded is not None:
            self._uploaded.synchronize()     # the last call's uploads have left the staging
        for i, (buf, a) in enumerate(zip(self.inputs, args)):
            if self._uploaded is not None and a.device.type == "cpu":
                if self._stage[i] is None:
                    self._stage[i] = torch.empty(a.shape, dtype=a.dtype, pin_memory=True)
                a = self._stage[i].copy_(a)
            buf.copy_(a, non_blocking=True)
        if self._uploaded is not None:      # on the stream the uploads went to
            self._uploaded.record(torch.cuda.current_stream(self.inputs[0].device))
        if self.graph is None:
            return self.fn(*self.inputs)
        self.graph.replay()
        return self.outputs
