"""The CUDA graphs a drafter's step replays (draft_service.kv_drafter): one per (greedy,
or sampled with its filter width; to a shallower depth; batch bucket, page bucket),
each step padded to its buckets; on the CPU the same function runs eagerly.
"""

from __future__ import annotations

from typing import Callable

import torch

from common.graph_buckets import MIN_PAGES, BucketedGraphs, bucket
from common.kv_cache import PagedKVCache, SeqPages
from common.sampling import GREEDY, TOPK_FIRST, SamplingParams, as_tensors, filter_width
from draft_service.proposer import RowSampling

# an extra per-unit input of a step: (shape of one unit's row, dtype)
Extra = tuple[tuple[int, ...], torch.dtype]


class DraftGraphs:
    """A drafter's step ``fn(tokens [B, C] int64, count [B] int32, ctx0 [B] int32,
    table [B, P] int32, *extras [B, C, ...], sampling=None, depth=0)`` captured per
    (batch bucket, page bucket), again per shallower depth (greedy), and with sampling (each row's [temperature, top_k,
    top_p, min_p, seed] and rejection flag [B], padding rows greedy, then the batch's
    filter width, a constant of the graph) for batches where a row samples: row b's
    first count[b] units are written from ctx0[b] on, the rest is padding. A sampled
    step's last two outputs are the trees' q_ids and q_probs."""

    def __init__(self, cache: PagedKVCache, catch_up_len: int,
                 fn: Callable[..., tuple[torch.Tensor, ...]], extras: list[Extra],
                 capture: bool = True) -> None:
        self.cache, self.fn, self.extras = cache, fn, extras
        self.catch_up_len = catch_up_len
        # captured graphs start at MIN_PAGES pages (on the CPU nothing is captured)
        on_gpu = capture and cache.device.type == "cuda"
        self.buckets = BucketedGraphs(cache, capture, MIN_PAGES if on_gpu else 1)

    @torch.inference_mode()
    def __call__(self, new_tokens: list[list[int]], new_extras: list[list[torch.Tensor]],
                 pages: list[SeqPages], sampling: list[RowSampling | None] | None = None,
                 depth: int = 0) -> tuple[torch.Tensor, ...]:
        """Row r's units: new_tokens[r] (1 .. catch_up_len) with new_extras[r][k]
        [same, *shape of extra k] on the device, written from pages[r].kv_len on;
        sampling[r] row r's (None: greedy); depth: a shallower tree's (0: the
        envelope's). Returns fn's outputs for the real rows (advancing kv_len is the
        caller's)."""
        gb, dev, c = self.buckets, self.cache.device, self.catch_up_len
        real = len(pages)
        b, p, table = gb.shape(pages)
        tokens, count, ctx0 = gb.chain_inputs(new_tokens, pages, b, c)
        extras = []
        if self.extras:          # each row's units at [r, :n] of [b, c], in one copy
            at = torch.tensor([r * c + i for r, t in enumerate(new_tokens)
                               for i in range(len(t))]).to(dev)
        for k, (shape, dtype) in enumerate(self.extras):
            x = torch.zeros((b, c, *shape), dtype=dtype, device=dev)
            x.view(b * c, *shape)[at] = torch.cat([rows[k] for rows in new_extras])
            extras.append(x)

        per_row, width = [], 0
        if sampling is not None:
            params = [r.params if r else GREEDY for r in sampling] + [GREEDY] * (b - real)
            per_row = _per_row(params, [bool(r and r.rejection) for r in sampling]
                               + [False] * (b - real), dev)
            width = filter_width(params)
        out = self._graph(b, p, per_row, width, depth)(tokens, count, ctx0, table, *extras,
                                                       *per_row)
        return tuple(x[:real].clone() for x in out)

    def _graph(self, b: int, p: int, per_row: list[torch.Tensor], width: int = 0,
               depth: int = 0):
        """The step's graph at batch bucket b and page bucket p (sampled when per_row
        holds the rows' sampling tensors; to depth when not 0), captured on first use."""
        gb, dev, c = self.buckets, self.cache.device, self.catch_up_len

        def example(bb: int) -> list[torch.Tensor]:
            return [torch.zeros((bb, c), dtype=torch.int64, device=dev),
                    torch.ones(bb, dtype=torch.int32, device=dev),
                    torch.zeros(bb, dtype=torch.int32, device=dev), gb.table_example(bb, p),
                    *[torch.zeros((bb, c, *shape), dtype=dtype, device=dev)
                      for shape, dtype in self.extras],
                    *[x[:1].expand(bb).contiguous() for x in per_row]]

        n = 4 + len(self.extras)

        def fn(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return self.fn(*xs[:n], sampling=[*xs[n:], width] if per_row else None,
                           depth=depth)

        family = ("step-sampled", width) if per_row else "step"
        return gb.get((family, depth) if depth else family, b, p, example, fn)

    def capture_all(self, max_batch: int, depths: tuple[int, ...] = ()) -> None:
        """Every family (greedy, also to each of depths; sampled from the top-k first
        or the whole vocabulary) at every batch bucket to max_batch's, smallest page
        bucket."""
        greedy = _per_row([GREEDY], [False], self.cache.device)
        for per_row, width, depth in (([], 0, 0), (greedy, TOPK_FIRST, 0), (greedy, -1, 0),
                                      *(([], 0, d) for d in depths)):
            self._graph(bucket(max_batch), self.buckets.min_pages, per_row, width, depth)


def _per_row(params: list[SamplingParams], rejection: list[bool], dev: torch.device
             ) -> list[torch.Tensor]:
    """A sampled step's per-row inputs: the sampling parameters and rejection flag."""
    return as_tensors(params, dev) + [torch.tensor(rejection, device=dev)]
