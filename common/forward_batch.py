"""Flattening a batch of forward chunks into the tensors the model and kernels take.

A chunk is the query tokens one sequence adds in one forward: a prefill span (a
chain) or [root, tree nodes] (a tree). See kernels/reference.py for the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.kv_cache import PagedKVCache, SeqPages


@dataclass
class Chunk:
    seq: SeqPages
    tokens: list[int]          # [T] query tokens
    parents: list[int]         # [T] chunk-local parent (-1 none, -2 padding)
    depths: list[int]          # [T] position offset from seq.kv_len


def chain_chunk(seq: SeqPages, tokens: list[int]) -> Chunk:
    """A prefill / decode span: each token's parent is the one before it."""
    n = len(tokens)
    return Chunk(seq, tokens, list(range(-1, n - 1)), list(range(n)))


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64
    slots: torch.Tensor          # [T] int64 flat KV slot of each query
    block_tables: torch.Tensor   # [B, max_pages] int32
    context_lens: torch.Tensor   # [B] int32 committed slots before each chunk
    cu_q: torch.Tensor           # [B + 1] int32 query offsets
    chunk_parents: torch.Tensor  # [T] int32
    last: torch.Tensor           # [B] int64 index of each chunk's last query

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


def build_forward_batch(chunks: list[Chunk], cache: PagedKVCache) -> ForwardBatch:
    """Reserve pages for each chunk's slots and lay the batch out flat."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    parents: list[int] = []
    cu = [0]
    for c in chunks:
        base = c.seq.kv_len
        cache.reserve(c.seq, base + len(c.tokens))
        ids.extend(c.tokens)
        pos.extend(base + d for d in c.depths)
        slots.extend(cache.slot(c.seq, base + i) for i in range(len(c.tokens)))
        parents.extend(c.parents)
        cu.append(cu[-1] + len(c.tokens))
    width = max(len(c.seq.pages) for c in chunks)
    table = [c.seq.pages + [0] * (width - len(c.seq.pages)) for c in chunks]
    dev = cache.device

    def t(x: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=dev)

    return ForwardBatch(
        input_ids=t(ids, torch.int64), positions=t(pos, torch.int64),
        slots=t(slots, torch.int64), block_tables=t(table, torch.int32),
        context_lens=t([c.seq.kv_len for c in chunks], torch.int32),
        cu_q=t(cu, torch.int32), chunk_parents=t(parents, torch.int32),
        last=t([x - 1 for x in cu[1:]], torch.int64))
