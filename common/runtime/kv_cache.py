"""A paged KV cache: page tensors for every layer plus per-sequence page tables.

Slots are positions in a sequence's KV. ``kv_len`` slots hold committed KV; a
forward chunk writes its K/V right after them (scratch for a tree). After
acceptance the accepted path is compacted in place (``treespec.kernels.compact_kv``) and
``kv_len`` advances; everything past it is forgotten, never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from treespec.common.runtime.block_manager import BlockManager


@dataclass
class SeqPages:
    """One sequence's page table and how many of its slots hold committed KV."""

    pages: list[int] = field(default_factory=list)
    kv_len: int = 0


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.device = device

    def reserve(self, seq: SeqPages, num_slots: int) -> None:
        """Make sure seq has pages for its first num_slots slots."""
        need = self.blocks.blocks_for(num_slots) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.blocks.allocate(need))

    def release(self, seq: SeqPages) -> None:
        """Return every page of seq; safe to call twice."""
        if seq.pages:
            self.blocks.free(seq.pages)
        seq.pages = []
        seq.kv_len = 0

    def slot(self, seq: SeqPages, pos: int) -> int:
        return seq.pages[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, seq: SeqPages, start: int, stop: int) -> np.ndarray:
        """slot() of positions start .. stop - 1, int64 (a prompt's in microseconds)."""
        at = np.arange(start, stop)
        return np.asarray(seq.pages, dtype=np.int64)[at // self.block_size] * self.block_size \
            + at % self.block_size
