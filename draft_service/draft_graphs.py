"""The CUDA graphs a drafter's step replays (treespec.draft_service.kv_drafter): one per (greedy,
or sampled with its filter width; to a shallower depth; batch bucket, page bucket),
each step padded to its buckets; on the CPU the same function runs eagerly.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from treespec.common.runtime.graph_buckets import MIN_PAGES, BucketedGraphs, bucket
from treespec.common.runtime.kv_cache import PagedKVCache, SeqPages
from treespec.common.spec import sampling_batch
from treespec.common.spec.sampling import GREEDY, TOPK_FIRST
from treespec.common.spec.sampling_batch import SamplingBatch
from treespec.draft_service.proposer import RowSampling

# an extra per-unit input of a step: (shape of one unit's row, dtype)
Extra = tuple[tuple[int, ...], torch.dtype]


class DraftGraphs:
    """A drafter's step ``fn(tokens [B, C] int64, count [B] int32, ctx0 [B] int32,
    table [B, P] int32, *extras [B, C, ...], sampling=None, depth=0)`` captured per
    (batch bucket, page bucket), again per shallower depth (greedy), and with sampling
    (each row's sampling columns (treespec.common.spec.sampling_batch) and rejection
    flag, padding rows greedy, then the batch's filter width, a constant of the graph) for
    batches where a row samples: row b's first count[b] units are written from
    ctx0[b] on, the rest is padding. A sampled step's last two outputs are the trees'
    q_ids and q_probs.

    A step uploads its host inputs as one int32 tensor (floats as their bits) and
    reads its outputs back as one: each transfer costs a call and a wait, and a
    drafter step at batch 1 is ~1 ms."""

    def __init__(self, cache: PagedKVCache, catch_up_len: int,
                 fn: Callable[..., tuple[torch.Tensor, ...]], extras: list[Extra],
                 capture: bool = True) -> None:
        self.cache, self.fn, self.extras = cache, fn, extras
        self.catch_up_len = catch_up_len
        # captured graphs start at MIN_PAGES pages (on the CPU nothing is captured)
        on_gpu = capture and cache.device.type == "cuda"
        self.buckets = BucketedGraphs(cache, capture, MIN_PAGES if on_gpu else 1)
        self._layout: dict[tuple, list[tuple[tuple[int, ...], torch.dtype]]] = {}

    @torch.inference_mode()
    def __call__(self, new_tokens: list[list[int]], new_extras: list[list[torch.Tensor]],
                 pages: list[SeqPages], sampling: list[RowSampling | None] | None = None,
                 depth: int = 0) -> tuple[torch.Tensor, ...]:
        """Row r's units: new_tokens[r] (1 .. catch_up_len) with new_extras[r][k]
        [same, *shape of extra k] on the device, written from pages[r].kv_len on;
        sampling[r] row r's (None: greedy); depth: a shallower tree's (0: the
        envelope's). Returns fn's outputs for the real rows, on the host (advancing
        kv_len is the caller's)."""
        gb, dev, c = self.buckets, self.cache.device, self.catch_up_len
        real = len(pages)
        b, p, table = gb.shape(pages)
        tokens, count, ctx0 = gb.chain_inputs(new_tokens, pages, b, c)
        cols = [tokens.int(), count.unsqueeze(1), ctx0.unsqueeze(1), table]
        extras = []
        if self.extras:          # each row's units at [r, :n] of [b, c], in one copy
            at = torch.tensor([r * c + i for r, t in enumerate(new_tokens)
                               for i in range(len(t))]).to(dev)
        for k, (shape, dtype) in enumerate(self.extras):
            x = torch.zeros((b, c, *shape), dtype=dtype, device=dev)
            x.view(b * c, *shape)[at] = torch.cat([rows[k] for rows in new_extras])
            extras.append(x)
        width = 0
        if sampling is not None:
            rows = SamplingBatch([r.params if r else GREEDY for r in sampling])
            cols.append(per_row(rows, [bool(r and r.rejection) for r in sampling], b))
            width = rows.width
        key, graph = self._graph(b, p, sampling is not None, width, depth)
        out = graph(torch.cat(cols, 1), *extras)[0][:real].cpu()
        return unpack(out, self._layout[key])

    def _graph(self, b: int, p: int, sampled: bool, width: int = 0, depth: int = 0):
        """(family, graph): the step's graph at batch bucket b and page bucket p
        (sampled: with the rows' sampling columns; to depth when not 0), captured on
        first use."""
        gb, dev, c = self.buckets, self.cache.device, self.catch_up_len
        n = c + 2 + p + (SAMPLING_COLS if sampled else 0)

        def example(bb: int) -> list[torch.Tensor]:
            packed = torch.zeros((bb, n), dtype=torch.int32, device=dev)
            packed[:, c] = 1                                    # one unit a row
            packed[:, c + 2:c + 2 + p] = gb.scratch
            if sampled:
                packed[:, c + 2 + p:] = per_row(SamplingBatch.greedy(1), [False], 1).to(dev)
            return [packed, *[torch.zeros((bb, c, *shape), dtype=dtype, device=dev)
                              for shape, dtype in self.extras]]

        family = ("step-sampled", width) if sampled else "step"
        key = (family, depth) if depth else family

        def fn(packed: torch.Tensor, *extras: torch.Tensor) -> tuple[torch.Tensor]:
            samp = None
            if sampled:
                x = packed[:, c + 2 + p:]
                samp = [*sampling_batch.unpack(x[:, :-1]), x[:, -1].bool(), width]
            out = self.fn(packed[:, :c].long(), packed[:, c].contiguous(),
                          packed[:, c + 1].contiguous(), packed[:, c + 2:c + 2 + p].contiguous(),
                          *extras, sampling=samp, depth=depth)
            self._layout[key] = [(tuple(x.shape[1:]), x.dtype) for x in out]
            return (pack(out),)

        return key, gb.get(key, b, p, example, fn)

    def capture_all(self, max_batch: int, depths: tuple[int, ...] = ()) -> None:
        """Every family (greedy, also to each of depths; sampled from the top-k first
        or the whole vocabulary) at every batch bucket to max_batch's, smallest page
        bucket."""
        for sampled, width, depth in ((False, 0, 0), (True, TOPK_FIRST, 0), (True, -1, 0),
                                      *((False, 0, d) for d in depths)):
            self._graph(bucket(max_batch), self.buckets.min_pages, sampled, width, depth)


SAMPLING_COLS = sampling_batch.WIDTH + 1     # a sampled step's columns: the rows' sampling
                                             # columns, then the rejection flag


def per_row(rows: SamplingBatch, rejection: list[bool], b: int) -> torch.Tensor:
    """A sampled step's host columns [b, SAMPLING_COLS] int32 (padding rows greedy)."""
    flags = np.zeros((b, 1), dtype=np.int32)
    flags[:len(rejection), 0] = rejection
    return torch.from_numpy(np.concatenate([rows.pack(b), flags], 1))


def pack(out: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A step's outputs [B, ...] as one int32 tensor [B, total]: floats as their float32
    bits, integers (ids, positions, flags: below 2^31) converted."""
    b = out[0].shape[0]
    return torch.cat([(x.float().view(torch.int32) if x.is_floating_point()
                       else x.to(torch.int32)).reshape(b, -1) for x in out], 1)


def unpack(packed: torch.Tensor, layout: list[tuple[tuple[int, ...], torch.dtype]]
           ) -> tuple[torch.Tensor, ...]:
    """pack's inverse, given each output's per-row shape and dtype."""
    out, at = [], 0
    for shape, dtype in layout:
        n = math.prod(shape)
        x = packed[:, at:at + n].contiguous().view(-1, *shape)
        out.append(x.view(torch.float32).to(dtype) if dtype.is_floating_point else x.to(dtype))
        at += n
    return tuple(out)
