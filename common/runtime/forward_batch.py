"""Flattening a batch of forward chunks into the tensors the model and kernels take.

A chunk is the query tokens one sequence adds in one forward: a prefill span (a
chain) or [root, tree nodes] (a tree). See kernels/reference.py for the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treespec.common.runtime.kv_cache import PagedKVCache, SeqPages


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
    # ops.tree_ancestors of equal-length tree chunks, when the caller computed it
    ancestors: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


def build_forward_batch(chunks: list[Chunk], cache: PagedKVCache) -> ForwardBatch:
    """Reserve pages for each chunk's slots and lay the batch out flat."""
    ids: list[int] = []
    parents: list[int] = []
    pos: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    cu = [0]
    for c in chunks:
        base, n = c.seq.kv_len, len(c.tokens)
        cache.reserve(c.seq, base + n)
        ids.extend(c.tokens)
        parents.extend(c.parents)
        pos.append(base + np.asarray(c.depths, dtype=np.int64))
        slots.append(cache.slots(c.seq, base, base + n))
        cu.append(cu[-1] + n)
    width = max(len(c.seq.pages) for c in chunks)
    table = [c.seq.pages + [0] * (width - len(c.seq.pages)) for c in chunks]
    dev = cache.device

    def t(x, dtype: type) -> torch.Tensor:      # via numpy: a list of ints converts 4 x faster
        return torch.from_numpy(np.asarray(x, dtype=dtype)).to(dev)

    return ForwardBatch(
        input_ids=t(ids, np.int64), positions=t(np.concatenate(pos), np.int64),
        slots=t(np.concatenate(slots), np.int64), block_tables=t(table, np.int32),
        context_lens=t([c.seq.kv_len for c in chunks], np.int32), cu_q=t(cu, np.int32),
        chunk_parents=t(parents, np.int32), last=t([x - 1 for x in cu[1:]], np.int64))


def device_forward_batch(tokens: torch.Tensor, chunk_parents: torch.Tensor,
                         depths: torch.Tensor, context_lens: torch.Tensor,
                         block_tables: torch.Tensor, block_size: int) -> ForwardBatch:
    """The same layout for B chunks of one length T, built on the device with no
    host sync (what a CUDA graph can hold).

    tokens [B, T] ints; chunk_parents [B, T] int32; depths [B, T] or [T] position
    offsets from each context_lens[b]; block_tables [B, P] int32 covering slots
    up to context_lens[b] + T. Chunk query i of sequence b writes slot
    context_lens[b] + i.
    """
    b, t = tokens.shape
    dev = tokens.device
    ctx = context_lens.long().unsqueeze(1)                                  # [B, 1]
    pos = ctx + torch.arange(t, device=dev)                                 # [B, T]
    return ForwardBatch(
        input_ids=tokens.long().reshape(-1),
        positions=(ctx + depths.long()).reshape(-1),
        slots=device_slots(block_tables, pos, block_size).reshape(-1),
        block_tables=block_tables, context_lens=context_lens,
        cu_q=torch.arange(0, b * t + 1, t, device=dev, dtype=torch.int32),
        chunk_parents=chunk_parents.to(torch.int32).reshape(-1),
        last=torch.arange(t - 1, b * t, t, device=dev))


def device_slots(block_tables: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """The flat KV slots [B, T] int64 of positions pos [B, T] int64 (on the device)."""
    return block_tables.gather(1, pos // block_size) * block_size + pos % block_size


def padded_chain_batch(tokens: torch.Tensor, count: torch.Tensor, context_lens: torch.Tensor,
                       block_tables: torch.Tensor, block_size: int) -> ForwardBatch:
    """device_forward_batch of B chains of up to T tokens: row b's first count[b]
    (>= 1) tokens are a chain written from context_lens[b] on, the rest padding
    (each sees only itself and nobody sees it; their slots, past the chain, must
    be reserved and are the caller's to overwrite or ignore)."""
    i = torch.arange(tokens.shape[1], device=tokens.device, dtype=torch.int32)
    parents = torch.where(i < count.unsqueeze(1), i - 1, -2)                     # [B, T]
    return device_forward_batch(tokens, parents, i, context_lens, block_tables, block_size)
