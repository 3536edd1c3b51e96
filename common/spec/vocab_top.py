"""A row's top k over a whole vocabulary, exactly, without ranking the row.

A GPU's topk over 151936 columns is slow (it ranks whole rows), and a drafter's tree
and every sampling row ask for a few of them. A row's top k lie in the k CHUNKs of
columns with the highest maxima: a chunk holding one of them has a maximum at least
that high, and at most k - 1 other chunks can beat it. So one pass for the chunks'
maxima (``treespec.kernels.vocab_stats``, which gives the row's log-sum-exp in the same read),
a top-k over those, and one over the k chosen chunks' columns (and the columns past
the last whole chunk) give topk's values; tied columns may differ.
"""

from __future__ import annotations

from types import ModuleType

import torch

CHUNK = 128


def top_k(x: torch.Tensor, k: int, maxima: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(k, -1) of x [R, V]: values and columns [R, k], largest first. maxima:
    each whole chunk's [R, V // CHUNK], when known."""
    r, v = x.shape
    c = v // CHUNK
    if c <= 4 * k:
        return x.topk(k, -1)
    whole = x[:, :c * CHUNK].view(r, c, CHUNK)
    best = (whole.amax(-1) if maxima is None else maxima).topk(k, -1).indices  # [R, k]
    cand = whole.gather(1, best.unsqueeze(-1).expand(-1, -1, CHUNK)).flatten(1)
    cols = (best.unsqueeze(-1) * CHUNK + torch.arange(CHUNK, device=x.device)).flatten(1)
    if v > c * CHUNK:                                                          # the tail
        cand = torch.cat([cand, x[:, c * CHUNK:]], 1)
        cols = torch.cat([cols, torch.arange(c * CHUNK, v, device=x.device).expand(r, -1)], 1)
    vals, at = cand.topk(k, -1)
    return vals, cols.gather(1, at)


def scaled_top(logits: torch.Tensor, temperature: torch.Tensor, k: int, ops: ModuleType
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits / T)'s top k, float32 values and columns [R, k] (T 1 where 0: a positive
    scale keeps the order, so the top k of the logits themselves), and the logits'
    log-sum-exp [R]."""
    lse, maxima = ops.vocab_stats(logits, CHUNK)
    vals, cols = top_k(logits, k, maxima)
    return vals.float() / torch.where(temperature > 0, temperature, 1.0).unsqueeze(-1), cols, lse
