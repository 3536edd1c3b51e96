"""The verify step on the GPU: ``fixed_step`` captured once per (batch, pages) bucket.

Same interface as ``verifier.Verifier`` (prefill, step), chosen once by the engine.
A step pads its batch to the next batch bucket (rows on a scratch page, all
padding) and its page tables to the next power-of-two width, copies the inputs
through one pinned buffer, replays, and reads back accepted / num / bonus in one
device-to-host copy: one host sync per step.
"""

from __future__ import annotations

from types import ModuleType

import torch

from common.cuda_graph import StaticGraph
from common.forward_batch import page_table
from common.kv_cache import PagedKVCache, SeqPages
from common.qwen3 import Qwen3Model
from verify_service.device_step import fixed_step
from verify_service.verifier import StepResult, Verifier

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PAD = -2


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"batch of {n} exceeds the largest bucket {buckets[-1]}")


class GraphVerifier(Verifier):
    reserved_pages = 1
    def __init__(self, model: Qwen3Model, cache: PagedKVCache, ops: ModuleType,
                 capture: bool = True) -> None:
        super().__init__(model, cache, ops)
        self.capture = capture
        self.scratch = cache.blocks.allocate(1)[0]      # padding rows write here
        self.graphs: dict[tuple, StaticGraph] = {}
        self._pool: object | None = None

    def _graph(self, b: int, n: int, p: int, depth: int) -> StaticGraph:
        """The graph for this shape. The first time a (nodes, pages) shape is met,
        every smaller batch bucket is captured with it: sequences of one batch
        finish at different steps, and the shrinking batch must not stall on a
        capture (seconds for a large model) in the middle of serving."""
        if (b, n, p, self.capture_layers) not in self.graphs:
            for smaller in BATCH_BUCKETS:
                if smaller < b:
                    self._capture(smaller, n, p, depth)
        return self._capture(b, n, p, depth)

    def _capture(self, b: int, n: int, p: int, depth: int) -> StaticGraph:
        key = (b, n, p, self.capture_layers)
        g = self.graphs.get(key)
        if g is None:
            dev = self.cache.device
            example = [torch.zeros(b, dtype=torch.int64, device=dev),
                       torch.zeros((b, n), dtype=torch.int32, device=dev),
                       torch.full((b, n), PAD, dtype=torch.int32, device=dev),
                       torch.zeros(b, dtype=torch.int32, device=dev),
                       torch.full((b, p), self.scratch, dtype=torch.int32, device=dev)]
            d = depth if n else 0
            cap = self.capture_layers

            def fn(*a: torch.Tensor) -> tuple[torch.Tensor, ...]:
                return fixed_step(self.model, self.cache, self.ops, d, cap, *a)

            with torch.inference_mode():
                g = StaticGraph(fn, example, capture=self.capture, pool=self._pool)
            self._pool = g.pool or self._pool
            self.graphs[key] = g
        return g

    @torch.inference_mode()
    def step(self, pages: list[SeqPages], roots: list[int], tokens: torch.Tensor | None,
             parents: torch.Tensor | None, depth: int) -> StepResult:
        real = len(pages)
        b = bucket(real, BATCH_BUCKETS)
        n = 0 if tokens is None else tokens.shape[1]
        for sp in pages:
            self.cache.reserve(sp, sp.kv_len + n + 1)
        width = max(len(sp.pages) for sp in pages)
        p = 1 << max(0, (width - 1).bit_length())
        host_roots = torch.zeros(b, dtype=torch.int64)
        host_roots[:real] = torch.tensor(roots)
        host_tokens = torch.zeros((b, n), dtype=torch.int32)
        host_parents = torch.full((b, n), PAD, dtype=torch.int32)
        if n:
            host_tokens[:real], host_parents[:real] = tokens, parents
        ctx = torch.zeros(b, dtype=torch.int32)
        ctx[:real] = torch.tensor([sp.kv_len for sp in pages])
        table = torch.full((b, p), self.scratch, dtype=torch.int32)
        table[:real, :width] = page_table(pages, torch.device("cpu"), fill=self.scratch)
        dev = self.cache.device
        args = [x.pin_memory() if dev.type == "cuda" else x
                for x in (host_roots, host_tokens, host_parents, ctx, table)]
        accepted, num, bonus, *path = self._graph(b, n, p, depth)(*args)
        out = torch.cat([accepted.long().view(-1), num.long(), bonus.long()]).cpu()
        d = accepted.shape[1]
        acc_l = out[:b * d].view(b, d).tolist()
        num_l = out[b * d:b * d + b].tolist()
        bonus_l = out[b * d + b:].tolist()
        for i, sp in enumerate(pages):
            sp.kv_len += 1 + num_l[i]
        rows = [path[0][i, :1 + num_l[i]].clone() for i in range(real)] if path else None
        return StepResult([acc_l[i][:num_l[i]] for i in range(real)], bonus_l[:real], rows)
