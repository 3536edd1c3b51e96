"""The verify step at a fixed shape, entirely on the device: what a CUDA graph holds.

``fixed_step`` takes [B] roots, [B, N] trees, [B] committed KV lengths and [B, P]
page tables; it derives depths, positions, slots and the chunk layout from
``parents`` on the device, runs the target over [root, nodes], picks the target's
tokens (its argmax, or a sampling row's seeded draw), walks the trees (a row with q
by rejection sampling: ``rejection_walk``) and compacts every accepted path's KV.
Nothing in it syncs with the host, and every shape depends only on (B, N, P), so one graph
per (batch bucket, page bucket) replays it. Rows of padding sequences point at a
scratch page and have all-padding trees; their results are ignored.
"""

from __future__ import annotations

from types import ModuleType

import torch

from treespec.common.spec.accept import commit_kv
from treespec.common.runtime.forward_batch import device_forward_batch
from treespec.common.runtime.kv_cache import PagedKVCache
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.spec.sampling import filter_draw
from treespec.common.spec.tree import ROOT, verify_chunk_layout


def fixed_step(model: Qwen3Model, cache: PagedKVCache, ops: ModuleType, depth: int,
               capture: tuple[int, ...], roots: torch.Tensor, tokens: torch.Tensor,
               parents: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
               sampling: list[torch.Tensor] | None = None,
               rejection: tuple[torch.Tensor, torch.Tensor, int] | None = None,
               width: int = -1) -> tuple[torch.Tensor, ...]:
    """roots [B] int64, tokens/parents [B, N] int32, context_lens [B] int32,
    block_tables [B, P] int32, sampling: None (every row greedy) or each row's
    [temperature, top_k, top_p, min_p, seed] [B] (treespec.common.spec.sampling.as_tensors),
    rejection: None or (q_ids, q_probs [B, N, Q], siblings tried per node), width:
    treespec.common.spec.sampling.filter_width of the rows' parameters ->
    accepted [B, depth] int32 (padded -1), num_accepted [B] int32, bonus [B] int64 and,
    when capture names target layers, their hidden states at [root, accepted path]
    [B, depth + 1, C] (rows past the path are junk). Advancing kv_len is the caller's.

    The target's choice at each node is its argmax, or for a sampling row its draw
    (treespec.common.spec.sampling.draw, keyed by the row's seed and the position it predicts), and
    a node is accepted iff its token is the target's choice at its parent; a sampling
    row with q (any nonzero) is accepted by rejection sampling instead."""
    b, n = tokens.shape
    t = n + 1
    if n:
        chunk_parents, depths = verify_chunk_layout(parents)             # [B, T]
        fb = device_forward_batch(torch.cat([roots.long().unsqueeze(1), tokens.long()], 1),
                                  chunk_parents, depths, context_lens, block_tables,
                                  cache.block_size)
        # each layer's attention reads these instead of walking parents up
        fb.ancestors = ops.tree_ancestors(chunk_parents)
    else:        # plain decode: the roots alone, no tree to lay out or walk
        dev = roots.device
        fb = device_forward_batch(roots.unsqueeze(1),
                                  torch.full((b, 1), ROOT, dtype=torch.int32, device=dev),
                                  torch.zeros(1, dtype=torch.int32, device=dev), context_lens,
                                  block_tables, cache.block_size)
    hidden, captured = model(fb, cache, ops, capture)
    if sampling is None:
        target_ids = model.greedy(hidden, ops).view(b, t)                # [B, T]
    else:
        per_row = sampling if t == 1 else [x.repeat_interleave(t) for x in sampling]
        logits = ops.linear(hidden, model.lm_head.weight)
        vals, ids, target_ids = filter_draw(logits, *per_row[:5], fb.positions + 1, width)
        target_ids = target_ids.view(b, t)
    if n:
        accepted, num, bonus = ops.accept_greedy(tokens, parents, target_ids, depth)
    else:
        accepted = torch.full((b, depth), -1, dtype=torch.int32, device=tokens.device)
        num, bonus = torch.zeros_like(context_lens), target_ids[:, 0]
    if rejection is not None and depth:
        q_ids, q_probs, siblings = rejection
        p_ids = ids.view(b, t, -1) if ids.shape[-1] < logits.shape[-1] else None
        if p_ids is None:        # the whole vocabulary sorted: p dense, in token order
            vals = torch.full_like(vals, float("-inf")).scatter(-1, ids, vals)
        walked = ops.rejection_walk(tokens, parents, vals.softmax(-1).view(b, t, -1), p_ids,
                                    q_ids, q_probs, sampling[4], (fb.positions + 1).view(b, t),
                                    depth, siblings)
        use = (sampling[0] > 0) & (q_probs.flatten(1) > 0).any(1)
        accepted, num, bonus = (torch.where(use.view(-1, *[1] * (x.dim() - 1)), w, x)
                                for w, x in zip(walked, (accepted, num, bonus)))
    if depth:
        commit_kv(cache, ops, accepted, num, context_lens, block_tables)
    if not capture:
        return accepted, num, bonus
    feats = torch.cat(captured, -1).view(b, t, -1)                       # [B, T, C]
    if not depth:                                                        # the root alone
        return accepted, num, bonus, feats[:, :1]
    root = torch.zeros((b, 1), dtype=accepted.dtype, device=accepted.device)
    rows = torch.cat([root, accepted.clamp(min=0) + 1], 1)
    path = torch.gather(feats, 1, rows.long().unsqueeze(-1).expand(-1, -1, feats.shape[-1]))
    return accepted, num, bonus, path
