"""The verify step on the GPU: ``fixed_step`` captured once per (batch, pages) bucket.

Same interface as ``verifier.Verifier`` (prefill, step), chosen once by the engine.
A step pads its batch to the next batch bucket (rows on a scratch page, all
padding) and its page tables to the next power-of-two width, packs every input
into one int32 tensor (one upload through the graph's pinned staging), replays,
and reads back accepted / num / bonus as one tensor (non-blocking, into a reused
pinned buffer): one host sync per step, and a handful of host-side torch calls
(the step's host time is on its critical path). ``launch`` returns before the
device is done, so the engine can wait on its event loop instead of in a thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from common.graph_buckets import BucketedGraphs
from common.kv_cache import PagedKVCache, SeqPages
from common.qwen3 import Qwen3Model
from verify_service.device_step import fixed_step
from verify_service.verifier import StepResult, Verifier

PAD = -2


class GraphVerifier(Verifier):
    reserved_pages = 1

    def __init__(self, model: Qwen3Model, cache: PagedKVCache, ops: ModuleType,
                 capture: bool = True) -> None:
        super().__init__(model, cache, ops)
        self.buckets = BucketedGraphs(cache, capture)
        self._host: dict[torch.Size, torch.Tensor] = {}     # pinned readback buffers
        self._done: torch.cuda.Event | None = None          # readback finished

    @property
    def graphs(self) -> dict:
        """Captured graphs by ((nodes, capture layers), batch bucket, page bucket)."""
        return self.buckets.graphs

    @torch.inference_mode()
    def step(self, pages: list[SeqPages], roots: list[int], tokens: torch.Tensor | None,
             parents: torch.Tensor | None, depth: int) -> StepResult:
        return self.finish(self.launch(pages, roots, tokens, parents, depth))

    def captured(self, pages: list[SeqPages], n: int) -> bool:
        """Whether a step of these sequences with n-node trees has its graph already
        (reserves the step's slots, as the step would)."""
        self._reserve(pages, n)
        b, p = self.buckets.buckets(pages)
        return ((n, self.capture_layers), b, p) in self.buckets.graphs

    def _reserve(self, pages: list[SeqPages], n: int) -> None:
        """Slots for [root, n nodes] past each committed length (idempotent)."""
        for sp in pages:
            self.cache.reserve(sp, sp.kv_len + n + 1)

    @torch.inference_mode()
    def launch(self, pages: list[SeqPages], roots: list[int], tokens: torch.Tensor | None,
               parents: torch.Tensor | None, depth: int) -> PendingStep:
        """Queue the step on the device and the readback of its results; returns at
        once. ``pending.ready()`` says whether the device is done (never blocks);
        ``finish(pending)`` completes the step (blocks until it is done)."""
        real = len(pages)
        n = 0 if tokens is None else tokens.shape[1]
        self._reserve(pages, n)
        gb = self.buckets
        b, p = gb.buckets(pages)
        walk, cap, dev = (depth if n else 0), self.capture_layers, self.cache.device

        def example(bb: int) -> list[torch.Tensor]:
            return [pack_inputs([0] * bb, [0] * bb, None if n == 0 else [[0] * n] * bb,
                                None if n == 0 else [[PAD] * n] * bb, [[]] * bb,
                                bb, p, n, gb.scratch).to(dev)]

        def fn(packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return packed_step(self.model, self.cache, self.ops, walk, cap, n, packed)

        graph = gb.get((n, cap), b, p, example, fn)
        packed = pack_inputs(roots, [sp.kv_len for sp in pages],
                             tokens.tolist() if n else None, parents.tolist() if n else None,
                             [sp.pages for sp in pages], b, p, n, gb.scratch)
        out, *path = graph(packed)
        host, done = self._readback(out)
        return PendingStep(pages[:real], host, done, path[0] if path else None)

    def _readback(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """out's values on the host: a non-blocking copy into a reused pinned buffer
        and an event after it (on the CPU, out itself)."""
        if out.device.type != "cuda":
            return out, None
        host = self._host.get(out.shape)
        if host is None:
            host = self._host[out.shape] = torch.empty(out.shape, dtype=out.dtype,
                                                       pin_memory=True)
        host.copy_(out, non_blocking=True)
        if self._done is None:          # one event, re-recorded: steps never overlap
            self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(out.device))
        return host, self._done

    @torch.inference_mode()
    def finish(self, pending: PendingStep) -> StepResult:
        """The step's results; advances each sequence's kv_len (the one host sync)."""
        if pending.done is not None:
            pending.done.synchronize()
        res = pending.host.tolist()
        d = pending.host.shape[1] - 2
        nums = [row[d] for row in res[:len(pending.pages)]]
        for sp, k in zip(pending.pages, nums):
            sp.kv_len += 1 + k
        rows = None
        if pending.path is not None:
            rows = [pending.path[i, :1 + nums[i]].clone() for i in range(len(nums))]
        return StepResult([res[i][:nums[i]] for i in range(len(nums))],
                          [res[i][d + 1] for i in range(len(nums))], rows)


@dataclass
class PendingStep:
    """A launched step: its sequences, the host copy of [B, depth + 2] results (valid
    once ``done`` has completed) and, when capturing, the path's hidden states."""
    pages: list[SeqPages]
    host: torch.Tensor
    done: torch.cuda.Event | None
    path: torch.Tensor | None

    def ready(self) -> bool:
        return self.done is None or self.done.query()


def pack_inputs(roots: list[int], ctx: list[int], tokens: list[list[int]] | None,
                parents: list[list[int]] | None, tables: list[list[int]], b: int, p: int,
                n: int, scratch: int) -> torch.Tensor:
    """One [b, 2 + 2n + p] int32 host tensor: root, committed KV length, tree tokens,
    tree parents, page table. Rows past len(roots) (and page-table tails) are padding
    on the scratch page; one tensor means one upload per step."""
    rows = []
    for i, table in enumerate(tables):
        row = [roots[i], ctx[i]]
        if n:
            row += tokens[i] + parents[i]
        rows.append(row + table + [scratch] * (p - len(table)))
    pad = [0, 0] + [0] * n + [PAD] * n + [scratch] * p
    return torch.tensor(rows + [pad] * (b - len(rows)), dtype=torch.int32)


def packed_step(model: Qwen3Model, cache: PagedKVCache, ops: ModuleType, depth: int,
                capture: tuple[int, ...], n: int, packed: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
    """fixed_step on pack_inputs' layout; returns [B, depth + 2] int64 (accepted
    nodes padded -1, number accepted, bonus token) and, when capturing, the path's
    hidden states: one tensor to read back."""
    roots, ctx = packed[:, 0].long(), packed[:, 1].contiguous()
    tokens, parents = packed[:, 2:2 + n].contiguous(), packed[:, 2 + n:2 + 2 * n].contiguous()
    table = packed[:, 2 + 2 * n:].contiguous()
    accepted, num, bonus, *path = fixed_step(model, cache, ops, depth, capture, roots, tokens,
                                             parents, ctx, table)
    out = torch.cat([accepted.long(), num.long().unsqueeze(1), bonus.long().unsqueeze(1)], 1)
    return (out, *path)
