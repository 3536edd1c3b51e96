"""A batch's sampling columns: the one int32 layout both services' step graphs take.

A step uploads its host inputs as one int32 tensor, so each row's sampling parameters
travel as ``WIDTH`` int32 columns, floats as their float32 bits::

    temperature | top_k | top_p | min_p | seed

``SamplingBatch.pack`` writes them on the host (rows past the batch's are padding,
greedy); ``unpack`` reads them back inside a graph as the per-row tensors
``treespec.common.spec.sampling.filter_draw`` takes. Example: one greedy row and one
at T 0.6, top-k 20, seed 7 pack as ``[[0, 0, bits(1.0), 0, 0], [bits(0.6), 20,
bits(1.0), 0, 7]]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from treespec.common.spec.sampling import GREEDY, SamplingParams, filter_width

COLUMNS = ("temperature", "top_k", "top_p", "min_p", "seed")
WIDTH = len(COLUMNS)


@dataclass(frozen=True)
class SamplingBatch:
    """The resolved sampling parameters of a batch's rows, in row order."""

    params: list[SamplingParams]

    @classmethod
    def greedy(cls, rows: int) -> SamplingBatch:
        return cls([GREEDY] * rows)

    @cached_property
    def width(self) -> int:
        """How the step draws (filter_width): 0 when no row does, so the graph skips it."""
        return filter_width(self.params)

    def pack(self, rows: int | None = None) -> np.ndarray:
        """[rows, WIDTH] int32 (rows: at least the batch's; the extra rows greedy)."""
        params = self.params + [GREEDY] * ((rows or len(self.params)) - len(self.params))
        f = np.array([[p.temperature, p.top_p, p.min_p] for p in params],
                     dtype=np.float32).reshape(-1, 3).view(np.int32)
        i = np.array([[p.top_k, p.seed] for p in params], dtype=np.int32).reshape(-1, 2)
        return np.stack([f[:, 0], i[:, 0], f[:, 1], f[:, 2], i[:, 1]], 1)


def unpack(cols: torch.Tensor) -> list[torch.Tensor]:
    """pack's columns [B, WIDTH] int32 -> [temperature, top_k, top_p, min_p, seed], each
    [B] (float32, int64, float32, float32, int64), on cols' device."""
    f = cols.contiguous().view(torch.float32)
    return [f[:, 0], cols[:, 1].long(), f[:, 2], f[:, 3], cols[:, 4].long()]
