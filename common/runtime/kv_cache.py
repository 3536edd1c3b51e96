"""A paged KV cache: page tensors for every layer plus per-sequence page tables.

Slots are positions in a sequence's KV. ``kv_len`` slots hold committed KV; a
forward chunk writes its K/V right after them (scratch for a tree). After
acceptance the accepted path is compacted in place (``treespec.kernels.compact_kv``) and
``kv_len`` advances; everything past it is forgotten, never read.

With prefix caching (``prefix`` set: treespec.common.runtime.prefix_cache) a sequence's
full pages below ``kv_len`` are registered by the keys of their tokens (``register``), a
new sequence starts from the pages of its longest cached prefix (``cached_prefix`` /
``take_prefix``), and a sequence that moves ``kv_len`` back over a cached page gets a
copy of its own first (``rewind``): a shared page is never written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from treespec.common.runtime.block_manager import BlockManager, OutOfPages
from treespec.common.runtime.prefix_cache import PrefixCache


@dataclass
class SeqPages:
    """One sequence's page table and how many of its slots hold committed KV."""

    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    keys: list[bytes] = field(default_factory=list)  # prefix keys of full pages below kv_len
    registered: int = 0     # leading pages offered to the prefix cache (<= len(keys))


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, prefix: str | None = None) -> None:
        """prefix: the model's identity, which turns prefix caching on (None: off)."""
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.prefix = None if prefix is None else \
            PrefixCache(num_blocks, block_size, f"{prefix}|{dtype}")
        self.blocks = self.prefix or BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.device = device

    def reserve(self, seq: SeqPages, num_slots: int) -> None:
        """Make sure seq has pages for its first num_slots slots."""
        need = self.blocks.blocks_for(num_slots) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.blocks.allocate(need))

    def release(self, seq: SeqPages) -> None:
        """Return every page of seq (cached ones stay cached); safe to call twice."""
        if seq.pages:
            self.blocks.free(seq.pages)
        seq.pages = []
        seq.kv_len = 0
        seq.keys, seq.registered = [], 0

    # ------------------------------------------------------------ prefix caching
    def cached_prefix(self, seq: SeqPages, tokens: list[int]) -> list[int]:
        """Pages of the longest cached prefix of tokens that leaves the last token to
        compute (its output is wanted), for seq, which holds none yet; nothing is taken.
        Keeps the keys computed in seq."""
        if self.prefix is None or not tokens:
            return []
        seq.keys = self.prefix.keys(tokens, (len(tokens) - 1) // self.block_size, seq.keys)
        return self.prefix.lookup(seq.keys)

    def take_prefix(self, seq: SeqPages, pages: list[int], num_tokens: int) -> int:
        """seq holds pages (cached_prefix's, just looked up) as its first pages; counts
        the query of num_tokens tokens; returns the tokens whose KV it got."""
        assert self.prefix is not None and not seq.pages
        self.prefix.hold(pages)
        seq.pages = list(pages)
        seq.registered = len(pages)
        seq.kv_len = len(pages) * self.block_size
        del seq.keys[len(pages):]       # keys name pages below kv_len only
        self.prefix.queries += num_tokens
        self.prefix.hits += seq.kv_len
        return seq.kv_len

    def register(self, seq: SeqPages, tokens: list[int]) -> None:
        """Offer seq's pages that are full below kv_len to the prefix cache (tokens: the
        sequence's, whose first kv_len have their KV written; KV past them, of draft
        tokens after a stop, is not offered)."""
        if self.prefix is None:
            return
        full = min(seq.kv_len, len(tokens)) // self.block_size
        if full <= seq.registered:
            return
        seq.keys = self.prefix.keys(tokens, full, seq.keys)
        for i in range(seq.registered, full):
            self.prefix.register(seq.pages[i], seq.keys[i])
        seq.registered = full

    def rewind(self, seq: SeqPages, kv_len: int) -> None:
        """Set kv_len back (forgetting the KV after it) so that what comes next may be
        written: a cached page at or after it is swapped for a copy of its own (or, with
        no page free, dropped with the pages after it, kv_len cut to its start)."""
        if kv_len >= seq.kv_len:
            return
        seq.kv_len = kv_len
        bs = self.block_size
        if self.prefix is not None:
            for i in range(kv_len // bs, min(seq.registered, len(seq.pages))):
                page = seq.pages[i]
                if not self.prefix.is_cached(page):
                    continue
                try:
                    (own,) = self.blocks.allocate(1)
                except OutOfPages:
                    self.blocks.free(seq.pages[i:])
                    del seq.pages[i:]
                    seq.kv_len = min(kv_len, i * bs)
                    break
                if i * bs < kv_len:         # the page kv_len is in: keep what precedes it
                    self.k[:, own] = self.k[:, page]
                    self.v[:, own] = self.v[:, page]
                self.blocks.free([page])
                seq.pages[i] = own
        del seq.keys[seq.kv_len // bs:]
        seq.registered = min(seq.registered, len(seq.keys))

    def slot(self, seq: SeqPages, pos: int) -> int:
        return seq.pages[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, seq: SeqPages, start: int, stop: int) -> np.ndarray:
        """slot() of positions start .. stop - 1, int64 (a prompt's in microseconds)."""
        at = np.arange(start, stop)
        return np.asarray(seq.pages, dtype=np.int64)[at // self.block_size] * self.block_size \
            + at % self.block_size
