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

import time
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

from treespec.common.runtime.forward_batch import build_forward_batch, chain_chunk
from treespec.common.runtime.graph_buckets import MIN_PAGES, BucketedGraphs, bucket
from treespec.common.runtime.kv_cache import PagedKVCache, SeqPages
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.spec import sampling_batch
from treespec.common.spec.sampling import TOPK_FIRST, SamplingParams, as_tensors, draw
from treespec.common.spec.sampling_batch import SamplingBatch
from treespec.common.spec.tree import PAD, TreeBatch
from treespec.verify_service.device_step import fixed_step


@dataclass(frozen=True)
class VerifyBatch:
    """What one step verifies: row r is sequence r's root (its last committed token,
    whose KV is not yet written) and its tree, drawn as its sampling row says."""

    pages: list[SeqPages]
    roots: list[int]
    trees: TreeBatch | None = None      # [B, N] (None: plain decode, the roots alone)
    depth: int = 0                      # the longest path the accept walk may take
    sampling: SamplingBatch | None = None   # None: every row greedy
    siblings: int = 1                   # children per node rejection sampling tries (topk)

    @property
    def num_nodes(self) -> int:
        return 0 if self.trees is None else self.trees.tokens.shape[1]


class StepFamily(NamedTuple):
    """What a step graph is captured for, besides its batch and page buckets."""

    nodes: int                  # tree width N (0: plain decode)
    layers: tuple[int, ...]     # target layers whose hidden states it returns
    width: int                  # how it draws (SamplingBatch.width; 0: no row draws)
    q: int = 0                  # rejection sampling: q's width (0: no row has q)
    siblings: int = 0           # ... and the children per node it tries


@dataclass
class StepResult:
    accepted: list[list[int]]   # per sequence: accepted node indices, root to leaf
    bonus: list[int]            # per sequence: the target's token after the path
    # per sequence, when capturing: target hidden states [1 + len(path), C] of the
    # root and the accepted nodes (device tensors), C = layers * hidden
    hidden: list[torch.Tensor] | None = None
    captured: bool = False      # the step captured a graph (its time is not a step's)


@dataclass
class PendingStep:
    """A launched step: its sequences, the host copy of [B, depth + 2] results (valid
    once ``done`` has completed) and, when capturing, the path's hidden states."""
    pages: list[SeqPages]
    host: torch.Tensor
    done: torch.cuda.Event | None
    path: torch.Tensor | None
    captured: bool = False

    def ready(self) -> bool:
        return self.done is None or self.done.query()


class Verifier:
    reserved_pages = 1          # the scratch page padding rows write to

    def __init__(self, model: Qwen3Model, cache: PagedKVCache, ops: ModuleType,
                 capture: bool = True, max_batch: int = 1) -> None:
        self.model, self.cache, self.ops = model, cache, ops
        self.capture_layers: tuple[int, ...] = ()   # target layers a drafter reads
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
        layers = self.capture_layers
        for family, depth in [(StepFamily(0, layers, width), 0) for width in (0, TOPK_FIRST, -1)] \
                + [(StepFamily(w, layers, 0), d) for w, d in self.budgets]:
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
        """Write the KV of each prompt's next chunk (prompts[i]: the tokens after the
        pages[i].kv_len already written); returns the token after each chunk (greedy, or
        drawn with its params) and, when capturing, each chunk's hidden states [len, C]."""
        fb = build_forward_batch([chain_chunk(p, t) for p, t in zip(pages, prompts)], self.cache)
        hidden, captured = self.model(fb, self.cache, self.ops, self.capture_layers)
        last = hidden[fb.last]
        if params is None or all(p.greedy for p in params):
            nxt = self.model.greedy(last, self.ops).tolist()
        else:
            position = torch.tensor([p.kv_len + len(t) for p, t in zip(pages, prompts)],
                                    device=last.device)
            nxt = draw(self.ops.linear(last, self.model.lm_head.weight),
                       *as_tensors(params, last.device), position=position).tolist()
        for p, t in zip(pages, prompts):
            p.kv_len += len(t)
        if not captured:
            return nxt, None
        feats = torch.cat(captured, dim=-1)
        cu = fb.cu_q.tolist()
        return nxt, [feats[cu[i]:cu[i + 1]] for i in range(len(prompts))]

    def step(self, batch: VerifyBatch) -> StepResult:
        """Verify one tree per sequence (or decode plain); blocks until done."""
        return self.finish(self.launch(batch))

    def has_graph(self, batch: VerifyBatch) -> bool:
        """Whether this step's graph is captured already (reserves the step's slots,
        as the step would)."""
        self._reserve(batch.pages, batch.num_nodes)
        b, p = self.buckets.buckets(batch.pages)
        return (self._family(batch), b, p) in self.buckets.graphs

    def _family(self, batch: VerifyBatch) -> StepFamily:
        width = batch.sampling.width if batch.sampling is not None else 0
        trees = batch.trees
        q = trees.q_ids.shape[2] if width and trees is not None and trees.q_ids is not None \
            else 0
        return StepFamily(batch.num_nodes, self.capture_layers, width, q,
                          batch.siblings if q else 0)

    def _reserve(self, pages: list[SeqPages], n: int) -> None:
        """Slots for [root, n nodes] past each committed length (idempotent)."""
        for sp in pages:
            self.cache.reserve(sp, sp.kv_len + n + 1)

    @torch.inference_mode()
    def launch(self, batch: VerifyBatch) -> PendingStep:
        """Queue the step and the readback of its results on the device; returns at
        once. ``finish(pending)`` completes it (blocks until the device is done). A
        step where every row is greedy runs a graph without the draw."""
        n, pages = batch.num_nodes, batch.pages
        self._reserve(pages, n)
        gb = self.buckets
        captures = gb.captures
        b, p = gb.buckets(pages)
        family = self._family(batch)
        if n and (family, b, p) not in gb.graphs:
            # a budget's first step here: every budget's graph now, so that the
            # controller trying another later stalls no step on a capture
            for w, d in self.budgets:
                if w != n:
                    self._graph(family._replace(nodes=w), d, b, p)
        graph = self._graph(family, batch.depth if n else 0, b, p)
        out, *path = graph(pack_inputs(batch, b, p, gb.scratch, family))
        host, done = self._readback(out)
        return PendingStep(pages, host, done, path[0] if path else None,
                           gb.captures != captures)

    def _graph(self, family: StepFamily, walk: int, b: int, p: int):
        """The step graph of this family accepting paths up to walk deep."""
        gb, dev, n = self.buckets, self.cache.device, family.nodes

        def example(bb: int) -> list[torch.Tensor]:
            pad = None if n == 0 else TreeBatch.padding(bb, n)
            if family.q:
                pad.q_ids = torch.zeros((bb, n, family.q), dtype=torch.int32)
                pad.q_probs = torch.zeros((bb, n, family.q))
            return [pack_inputs(VerifyBatch([SeqPages()] * bb, [0] * bb, pad,
                                             sampling=SamplingBatch.greedy(bb)),
                                bb, p, gb.scratch, family).to(dev)]

        def fn(packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return packed_step(self.model, self.cache, self.ops, walk, family, packed)

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
                          [res[i][d + 1] for i in range(len(nums))], rows, pending.captured)


def pack_inputs(batch: VerifyBatch, b: int, p: int, scratch: int,
                family: StepFamily) -> torch.Tensor:
    """One [b, 2 (+ S) + 2N (+ 2NQ) + p] int32 host tensor: root, committed KV length,
    (when the family draws: the sampling columns, treespec.common.spec.sampling_batch),
    tree tokens, tree parents, (for rejection sampling, Q wide: q ids, q probabilities'
    bits), page table. Rows past the batch's (and page-table tails) are padding on the
    scratch page; one tensor means one upload per step."""
    n, q, trees = family.nodes, family.q, batch.trees
    r = len(batch.roots)
    at = 2 + sampling_batch.WIDTH if family.width else 2
    # in numpy: as Python lists, a b64 step's 16k ints were the most of its host time
    out = np.zeros((b, at + 2 * n + 2 * n * q + p), dtype=np.int32)
    out[:r, 0], out[:r, 1] = batch.roots, [sp.kv_len for sp in batch.pages]
    if family.width:
        out[:, 2:at] = batch.sampling.pack(b)
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
    for i, sp in enumerate(batch.pages):
        table[i, :len(sp.pages)] = sp.pages
    return torch.from_numpy(out)


def packed_step(model: Qwen3Model, cache: PagedKVCache, ops: ModuleType, depth: int,
                family: StepFamily, packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fixed_step on pack_inputs' layout; returns [B, depth + 2] int64 (accepted
    nodes padded -1, number accepted, bonus token) and, when capturing, the path's
    hidden states: one tensor to read back."""
    n, q = family.nodes, family.q
    roots, ctx = packed[:, 0].long(), packed[:, 1].contiguous()
    at = 2 + sampling_batch.WIDTH if family.width else 2
    sampling = sampling_batch.unpack(packed[:, 2:at]) if family.width else None
    tokens, parents = packed[:, at:at + n].contiguous(), packed[:, at + n:at + 2 * n].contiguous()
    at += 2 * n
    rejection = None
    if q:
        q_ids = packed[:, at:at + n * q].reshape(-1, n, q)
        q_probs = packed[:, at + n * q:at + 2 * n * q].contiguous().view(torch.float32)
        rejection = (q_ids, q_probs.reshape(-1, n, q), family.siblings)
        at += 2 * n * q
    table = packed[:, at:].contiguous()
    accepted, num, bonus, *path = fixed_step(model, cache, ops, depth, family.layers, roots,
                                             tokens, parents, ctx, table, sampling, rejection,
                                             family.width)
    out = torch.cat([accepted.long(), num.long().unsqueeze(1), bonus.long().unsqueeze(1)], 1)
    return (out, *path)
