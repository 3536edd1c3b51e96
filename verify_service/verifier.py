"""The target's forwards: prefill, and the verify step at fixed shapes.

The step (``device_step.fixed_step``) is one target forward over [root, tree nodes]
of every sequence, greedy acceptance and the KV commit, all on the device; it is
captured as a CUDA graph per (batch bucket, page bucket) on a GPU and run eagerly
over the same static buffers on the CPU, so both run one code path. A step pads
its batch to the next bucket (padding rows on a scratch page, all-padding trees)
and its page tables to the next power of two, packs every input into one int32
tensor (one upload through the graph's pinned staging), replays, and reads back
accepted / num / bonus as one tensor through a reused pinned buffer: one host sync
per step. ``launch`` returns before the device is done, so the engine can poll
for it on its event loop (treespec.verify_service.step_runner).

No request state lives here: it takes page tables, roots and trees and returns
what was accepted; the engine owns the bookkeeping (terms: common/spec/accept.py).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from treespec.common.runtime.forward_batch import build_forward_batch, chain_chunk
from treespec.common.runtime.graph_buckets import MIN_PAGES, BucketedGraphs, bucket
from treespec.common.runtime.kv_cache import PagedKVCache, SeqPages
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.spec.sampling import (GREEDY, TOPK_FIRST, SamplingParams, as_tensors, draw,
                             filter_width)
from treespec.common.spec.tree import PAD, TreeBatch
from treespec.verify_service.device_step import fixed_step


@dataclass
class StepResult:
    accepted: list[list[int]]   # per sequence: accepted node indices, root to leaf
    bonus: list[int]            # per sequence: the target's token after the path
    # per sequence, when capturing: target hidden states [1 + len(path), C] of the
    # root and the accepted nodes (device tensors), C = layers * hidden
    hidden: list[torch.Tensor] | None = None


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


class Verifier:
    reserved_pages = 1          # the scratch page padding rows write to

    def __init__(self, model: Qwen3Model, cache: PagedKVCache, ops: ModuleType,
                 capture: bool = True, max_batch: int = 1) -> None:
        self.model, self.cache, self.ops = model, cache, ops
        self.capture_layers: tuple[int, ...] = ()   # target layers a drafter reads
        self.siblings = 1           # children per node rejection sampling tries (topk)
        self.budgets: list[tuple[int, int]] = []   # (tree width, depth) the controller uses
        on_gpu = capture and cache.device.type == "cuda"
        self.buckets = BucketedGraphs(cache, capture, MIN_PAGES if on_gpu else 1, max_batch)
        self._host: dict[torch.Size, torch.Tensor] = {}     # pinned readback buffers
        self._done: torch.cuda.Event | None = None          # readback finished

    def warm_up(self) -> float:
        """Capture plain decode's graphs (greedy, and drawing from the top-k first or
        from the whole vocabulary) and each budget's greedy graph at every batch bucket
        up to max_batch's, first page bucket, so that no early request stalls on one
        (nor a batch on a budget's first non-empty tree); the seconds taken."""
        t0 = time.perf_counter()
        gb = self.buckets
        for family, depth in [((0, self.capture_layers, width, 0, 0), 0)
                              for width in (0, TOPK_FIRST, -1)] + \
                [((w, self.capture_layers, 0, 0, 0), d) for w, d in self.budgets]:
            self._graph(family, depth, bucket(gb.max_batch), gb.min_pages)
        return time.perf_counter() - t0

    def use_draft(self, layers: tuple[int, ...], budgets: list[tuple[int, int]]) -> bool:
        """Serve a draft that reads these target layers (set before any prefill it
        needs), with these budgets; whether that changed the graphs steps need (then
        warm_up again, where graphs capture)."""
        changed = (layers, budgets) != (self.capture_layers, self.budgets)
        self.capture_layers, self.budgets = layers, budgets
        return changed and self.buckets.capture and self.cache.device.type == "cuda"

    @torch.inference_mode()
    def prefill(self, pages: list[SeqPages], prompts: list[list[int]],
                params: list[SamplingParams] | None = None
                ) -> tuple[list[int], list[torch.Tensor] | None]:
        """Write every prompt's KV; returns each prompt's next token (greedy, or drawn
        with its params) and, when capturing, each prompt's hidden states [len, C]."""
        fb = build_forward_batch([chain_chunk(p, t) for p, t in zip(pages, prompts)], self.cache)
        hidden, captured = self.model(fb, self.cache, self.ops, self.capture_layers)
        last = hidden[fb.last]
        if params is None or all(p.greedy for p in params):
            nxt = self.model.greedy(last, self.ops).tolist()
        else:
            position = torch.tensor([len(t) for t in prompts], device=last.device)
            nxt = draw(self.ops.linear(last, self.model.lm_head.weight),
                       *as_tensors(params, last.device), position=position).tolist()
        for p, t in zip(pages, prompts):
            p.kv_len += len(t)
        if not captured:
            return nxt, None
        feats = torch.cat(captured, dim=-1)
        cu = fb.cu_q.tolist()
        return nxt, [feats[cu[i]:cu[i + 1]] for i in range(len(prompts))]

    def step(self, pages: list[SeqPages], roots: list[int], trees: TreeBatch | None,
             depth: int, params: list[SamplingParams] | None = None) -> StepResult:
        """Verify one tree per sequence (None: plain decode), each drawing as its
        params say (None: every one greedy); blocks until done."""
        return self.finish(self.launch(pages, roots, trees, depth, params))

    def captured(self, pages: list[SeqPages], trees: TreeBatch | None,
                 params: list[SamplingParams] | None = None) -> bool:
        """Whether a step of these sequences with these trees has its graph already
        (reserves the step's slots, as the step would)."""
        n = 0 if trees is None else trees.tokens.shape[1]
        self._reserve(pages, n)
        b, p = self.buckets.buckets(pages)
        return (self._family(n, params, trees), b, p) in self.buckets.graphs

    def _family(self, n: int, params: list[SamplingParams] | None,
                trees: TreeBatch | None) -> tuple:
        """A step graph's family: tree size, captured layers, how it draws
        (treespec.common.spec.sampling.filter_width: 0 it does not), and for rejection sampling q's
        width and the siblings tried per node."""
        sampled = filter_width(params)
        q = trees.q_ids.shape[2] if sampled and n and trees.q_ids is not None else 0
        return n, self.capture_layers, sampled, q, self.siblings if q else 0

    def _reserve(self, pages: list[SeqPages], n: int) -> None:
        """Slots for [root, n nodes] past each committed length (idempotent)."""
        for sp in pages:
            self.cache.reserve(sp, sp.kv_len + n + 1)

    @torch.inference_mode()
    def launch(self, pages: list[SeqPages], roots: list[int], trees: TreeBatch | None,
               depth: int, params: list[SamplingParams] | None = None) -> PendingStep:
        """Queue the step and the readback of its results on the device; returns at
        once. ``finish(pending)`` completes it (blocks until the device is done). A
        step where every row is greedy runs a graph without the draw."""
        n = 0 if trees is None else trees.tokens.shape[1]
        self._reserve(pages, n)
        gb = self.buckets
        b, p = gb.buckets(pages)
        family = self._family(n, params, trees)
        if n and (family, b, p) not in gb.graphs:
            # a budget's first step here: every budget's graph now, so that the
            # controller trying another later stalls no step on a capture
            for w, d in self.budgets:
                if w != n:
                    self._graph((w, *family[1:]), d, b, p)
        graph = self._graph(family, depth if n else 0, b, p)
        sampled, q = family[2:4]
        out, *path = graph(pack_inputs(roots, [sp.kv_len for sp in pages], trees,
                                       [sp.pages for sp in pages], b, p, gb.scratch,
                                       params if sampled else None, q))
        host, done = self._readback(out)
        return PendingStep(pages, host, done, path[0] if path else None)

    def _graph(self, family: tuple, walk: int, b: int, p: int):
        """The step graph of this family (_family) accepting paths up to walk deep."""
        n, cap, sampled, q, siblings = family
        gb, dev = self.buckets, self.cache.device

        def example(bb: int) -> list[torch.Tensor]:
            pad = None if n == 0 else TreeBatch.padding(bb, n)
            if q:
                pad.q_ids = torch.zeros((bb, n, q), dtype=torch.int32)
                pad.q_probs = torch.zeros((bb, n, q))
            return [pack_inputs([0] * bb, [0] * bb, pad, [[]] * bb, bb, p, gb.scratch,
                                [GREEDY] * bb if sampled else None, q).to(dev)]

        def fn(packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return packed_step(self.model, self.cache, self.ops, walk, cap, n, sampled, packed,
                               q, siblings)

        return gb.get(family, b, p, example, fn)

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
        if pending.path is not None:    # one copy out of the graph's output, views of it
            path = pending.path[:len(nums), :1 + max(nums, default=0)].clone()
            rows = [path[i, :1 + k] for i, k in enumerate(nums)]
        return StepResult([res[i][:nums[i]] for i in range(len(nums))],
                          [res[i][d + 1] for i in range(len(nums))], rows)


def _bits(x: float) -> int:
    """A float32's bits as an int32 (sampling parameters travel in the int32 pack)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def pack_inputs(roots: list[int], ctx: list[int], trees: TreeBatch | None,
                tables: list[list[int]], b: int, p: int, scratch: int,
                params: list[SamplingParams] | None = None, q: int = 0) -> torch.Tensor:
    """One [b, 2 (+ 5) + 2N (+ 2NQ) + p] int32 host tensor: root, committed KV length,
    (when drawing: temperature, top_k, top_p, min_p, seed), tree tokens, tree parents,
    (for rejection sampling, q wide: q ids, q probabilities' bits), page table. Rows
    past len(roots) (and page-table tails) are padding on the scratch page; one tensor
    means one upload per step."""
    n = 0 if trees is None else trees.tokens.shape[1]
    r, at = len(roots), 7 if params is not None else 2
    # in numpy: as Python lists, a b64 step's 16k ints were the most of its host time
    out = np.zeros((b, at + 2 * n + 2 * n * q + p), dtype=np.int32)
    out[:r, 0], out[:r, 1] = roots, ctx
    if params is not None:
        out[:, 2:7] = [_bits(0.0), 0, _bits(1.0), _bits(0.0), 0]        # padding rows: greedy
        out[:r, 2:7] = [[_bits(x.temperature), x.top_k, _bits(x.top_p), _bits(x.min_p),
                         x.seed] for x in params]
    if n:
        out[:r, at:at + n] = trees.tokens.numpy()
        out[:, at + n:at + 2 * n] = PAD
        out[:r, at + n:at + 2 * n] = trees.parents.numpy()
    if q:
        out[:r, at + 2 * n:at + 2 * n + n * q] = trees.q_ids.reshape(-1, n * q).numpy()
        out[:r, at + 2 * n + n * q:at + 2 * n + 2 * n * q] = (
            trees.q_probs.float().view(torch.int32).reshape(-1, n * q).numpy())
    table = out[:, out.shape[1] - p:]
    table[:] = scratch
    for i, pages in enumerate(tables):
        table[i, :len(pages)] = pages
    return torch.from_numpy(out)


def packed_step(model: Qwen3Model, cache: PagedKVCache, ops: ModuleType, depth: int,
                capture: tuple[int, ...], n: int, sampled: int, packed: torch.Tensor,
                q: int = 0, siblings: int = 0) -> tuple[torch.Tensor, ...]:
    """fixed_step on pack_inputs' layout; returns [B, depth + 2] int64 (accepted
    nodes padded -1, number accepted, bonus token) and, when capturing, the path's
    hidden states: one tensor to read back. sampled: filter_width (0: no row draws)."""
    roots, ctx = packed[:, 0].long(), packed[:, 1].contiguous()
    sampling = None
    if sampled:
        f = packed[:, 2:7].contiguous().view(torch.float32)            # the same bits
        sampling = [f[:, 0], packed[:, 3].long(), f[:, 2], f[:, 3], packed[:, 6].long()]
    at = 7 if sampled else 2
    tokens, parents = packed[:, at:at + n].contiguous(), packed[:, at + n:at + 2 * n].contiguous()
    at += 2 * n
    rejection = None
    if q:
        q_ids = packed[:, at:at + n * q].reshape(-1, n, q)
        q_probs = packed[:, at + n * q:at + 2 * n * q].contiguous().view(torch.float32)
        rejection = (q_ids, q_probs.reshape(-1, n, q), siblings)
        at += 2 * n * q
    table = packed[:, at:].contiguous()
    accepted, num, bonus, *path = fixed_step(model, cache, ops, depth, capture, roots, tokens,
                                             parents, ctx, table, sampling, rejection,
                                             sampled)
    out = torch.cat([accepted.long(), num.long().unsqueeze(1), bonus.long().unsqueeze(1)], 1)
    return (out, *path)
