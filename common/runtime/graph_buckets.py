"""Fixed-shape functions captured per (batch bucket, page bucket), with a scratch page.

A step that runs at fixed shapes pads its batch to the next batch bucket (padding
rows point every page at one scratch page and their results are dropped) and its
page tables to the next power-of-two width. ``BucketedGraphs`` owns the scratch
page, the shared CUDA graph memory pool and one ``treespec.common.runtime.cuda_graph.StaticGraph``
per (family, batch bucket, page bucket); a family names one function and its
other static shapes. The first capture at a (family, page bucket) also captures
every other batch bucket up to ``max_batch``'s: a batch grows and shrinks as
requests come and go, and no step of it may stall on a capture (seconds for a large
model) in the middle of serving. Captured page buckets start at ``min_pages``
(MIN_PAGES on a GPU), so a sequence up to that many pages never meets a new one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

import numpy as np
import torch

from treespec.common.runtime.cuda_graph import StaticGraph
from treespec.common.runtime.kv_cache import PagedKVCache, SeqPages

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# the smallest captured page bucket (4096 tokens of 16): a wider table than the context
# costs only attention splits that find nothing to read
MIN_PAGES = 256

log = logging.getLogger("treespec.graphs")

Example = Callable[[int], list[torch.Tensor]]   # batch bucket -> example inputs
Fn = Callable[..., tuple[torch.Tensor, ...]]


def bucket(n: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """The smallest bucket holding n (n itself past the largest)."""
    return next((b for b in buckets if n <= b), n)


def _page_bucket(width: int) -> int:
    return 1 << max(0, (width - 1).bit_length())


class BucketedGraphs:
    def __init__(self, cache: PagedKVCache, capture: bool = True, min_pages: int = 1,
                 max_batch: int = 1) -> None:
        self.cache, self.capture = cache, capture
        self.min_pages = min_pages       # the smallest page bucket
        self.max_batch = max_batch       # a first capture covers the buckets up to this one's
        self.scratch = cache.blocks.allocate(1)[0]        # padding rows write here
        self.graphs: dict[tuple, StaticGraph] = {}
        self.captures = 0                # graphs made so far (a step that made one is slow)
        self._pool: object | None = None

    def get(self, family: Hashable, b: int, p: int, example: Example, fn: Fn) -> StaticGraph:
        """The graph of fn at (family, b, p), captured (with every batch bucket up to
        max_batch's) on first use; example(bb) gives inputs of batch bb to capture on."""
        top = max(b, bucket(self.max_batch))
        new = sorted({x for x in BATCH_BUCKETS if x <= top} | {b})
        new = [bb for bb in new if (family, bb, p) not in self.graphs]
        t0 = time.perf_counter()
        for bb in new:
            with torch.inference_mode():
                g = StaticGraph(fn, example(bb), capture=self.capture, pool=self._pool)
            self._pool = g.pool or self._pool
            self.graphs[(family, bb, p)] = g
            self.captures += 1
        if new and self.graphs[(family, b, p)].graph is not None:
            log.info("captured %s at batch buckets %s, %d pages: %.2f s", family, new, p,
                     time.perf_counter() - t0)
        return self.graphs[(family, b, p)]

    def buckets(self, pages: list[SeqPages]) -> tuple[int, int]:
        """(batch bucket, page bucket: the next power of two of the widest table, at
        least min_pages)."""
        return bucket(len(pages)), max(self.min_pages,
                                       _page_bucket(max(len(sp.pages) for sp in pages)))

    def shape(self, pages: list[SeqPages]) -> tuple[int, int, torch.Tensor]:
        """(batch bucket, page bucket, [b, p] int32 page table on the host, padded
        with the scratch page)."""
        b, p = self.buckets(pages)
        table = np.full((b, p), self.scratch, dtype=np.int32)
        for r, sp in enumerate(pages):      # row by row: a list per row, not per page
            table[r, :len(sp.pages)] = sp.pages
        return b, p, torch.from_numpy(table)

    @staticmethod
    def chain_inputs(new_tokens: list[list[int]], pages: list[SeqPages], b: int, c: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host inputs of a padded catch-up (forward_batch.padded_chain_batch) for a
        batch bucket of b: tokens [b, c] int64, count [b] and context lengths [b]
        int32; padding rows hold one token at position 0."""
        tokens = np.zeros((b, c), dtype=np.int64)
        count = np.ones(b, dtype=np.int32)
        ctx0 = np.zeros(b, dtype=np.int32)
        for r, (new, sp) in enumerate(zip(new_tokens, pages)):
            tokens[r, :len(new)] = new
            count[r], ctx0[r] = len(new), sp.kv_len
        return torch.from_numpy(tokens), torch.from_numpy(count), torch.from_numpy(ctx0)

    def batches(self, family: Hashable) -> list[int]:
        """Batch buckets captured so far for family (tests and logs)."""
        return sorted({k[1] for k in self.graphs if k[0] == family})
