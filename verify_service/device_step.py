"""The verify step at a fixed shape, entirely on the device: what a CUDA graph holds.

``fixed_step`` takes [B] roots, [B, N] trees, [B] committed KV lengths and [B, P]
page tables; it derives depths, positions, slots and the chunk layout from
``parents`` on the device, runs the target over [root, nodes], picks the target's
greedy tokens, walks the trees and compacts every accepted path's KV. Nothing in
it syncs with the host, and every shape depends only on (B, N, P), so one graph
per (batch bucket, page bucket) replays it. Rows of padding sequences point at a
scratch page and have all-padding trees; their results are ignored.
"""

from __future__ import annotations

from types import ModuleType

import torch

from common.forward_batch import device_forward_batch
from common.kv_cache import PagedKVCache
from common.qwen3 import Qwen3Model
from common.tree import verify_chunk_layout


def fixed_step(model: Qwen3Model, cache: PagedKVCache, ops: ModuleType, depth: int,
               capture: tuple[int, ...], roots: torch.Tensor, tokens: torch.Tensor,
               parents: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor
               ) -> tuple[torch.Tensor, ...]:
    """roots [B] int64, tokens/parents [B, N] int32, context_lens [B] int32,
    block_tables [B, P] int32 -> accepted [B, depth] int32 (padded -1),
    num_accepted [B] int32, bonus [B] int64 and, when capture names target layers,
    their hidden states at [root, accepted path] [B, depth + 1, C] (rows past the
    path are junk). Advancing kv_len is the caller's."""
    b, n = tokens.shape
    t = n + 1
    chunk_parents, depths = verify_chunk_layout(parents)                 # [B, T]
    ctx = context_lens.long().unsqueeze(1)                               # [B, 1]
    fb = device_forward_batch(torch.cat([roots.long().unsqueeze(1), tokens.long()], 1),
                              chunk_parents, depths, context_lens, block_tables,
                              cache.block_size)
    if n:        # each layer's attention reads these instead of walking parents up
        fb.ancestors = ops.tree_ancestors(chunk_parents)
    hidden, captured = model(fb, cache, ops, capture)
    target_ids = model.greedy(hidden, ops).view(b, t)                    # [B, T]
    accepted, num, bonus = ops.accept_greedy(tokens, parents, target_ids, depth)
    if depth:
        _compact_fixed(cache, ops, accepted, num, ctx, block_tables)
    if not capture:
        return accepted, num, bonus
    feats = torch.cat(captured, -1).view(b, t, -1)                       # [B, T, C]
    root = torch.zeros((b, 1), dtype=accepted.dtype, device=accepted.device)  # also when depth 0
    rows = torch.cat([root, accepted.clamp(min=0) + 1], 1)
    path = torch.gather(feats, 1, rows.long().unsqueeze(-1).expand(-1, -1, feats.shape[-1]))
    return accepted, num, bonus, path


def _compact_fixed(cache: PagedKVCache, ops: ModuleType, accepted: torch.Tensor,
                   num: torch.Tensor, ctx: torch.Tensor, block_tables: torch.Tensor) -> None:
    """common.accept.commit_plan at a fixed shape: entries past num_accepted become
    moves of a slot onto itself (slots past the new kv_len, never read again), so
    per sequence dst stays strictly increasing with src >= dst."""
    b, d = accepted.shape
    bs = cache.block_size
    i = torch.arange(d, device=accepted.device).unsqueeze(0)
    dst = ctx + 1 + i                                                    # [B, D]
    src = torch.where(i < num.long().unsqueeze(1), ctx + 1 + accepted.long(), dst)
    table = block_tables.long()

    def flat(pos: torch.Tensor) -> torch.Tensor:
        return (torch.gather(table, 1, pos // bs) * bs + pos % bs).view(-1)

    ops.compact_kv(cache.k, cache.v, flat(src), flat(dst))
