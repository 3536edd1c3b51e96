"""The draft model's step at a fixed shape, entirely on the device (what its CUDA
graph holds: treespec.draft_service.draft_graphs.DraftGraphs).

``catch_up_and_expand``: a [B, depth + 1] catch-up chain whose unused tail is
padding, then ``expand``: EAGLE-2 expansion over depth - 1 tree chunks
(``tree_build.Expansion``) and the rerank, or for a chain ``greedy_chain``: each
level forwards only its one new token per row (the levels before it already wrote
their KV) and takes the argmax (a sampling batch: the first pick, ``SampledChain``),
with no tree bookkeeping. Every shape depends only on (B, P) for a given envelope.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch

from treespec.common.runtime.forward_batch import (ForwardBatch, device_forward_batch, device_slots,
                                  padded_chain_batch)
from treespec.common.runtime.kv_cache import PagedKVCache
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.spec.tree import TreeEnvelope
from treespec.common.spec.sampling import draft_scores
from treespec.draft_service.tree_build import Expansion


def level_depths(env: TreeEnvelope, device: torch.device) -> list[torch.Tensor]:
    """Position offsets of each expansion chunk (levels 1..depth-1), made up front
    so nothing is copied from the host inside a capture."""
    return [torch.tensor([lv for lv in range(level) for _ in range(env.topk)], device=device)
            for level in range(1, env.depth)]


def scores(logits: torch.Tensor, sampling: list[torch.Tensor] | None, position: torch.Tensor,
           ids: torch.Tensor | None = None) -> tuple:
    """(log-probs, picks, q, columns) of logits [B, K, V] (or [B, V]) whose tokens
    would sit at position [B] (or [B, K]: each its own) of their sequences
    (treespec.common.spec.sampling.draft_scores): when the batch samples, over each row's W
    candidate columns [B, K, W], with picks and q (ids, probs); else the log-probs
    [B, K, V] alone (sampling: each row's [temperature, top_k, top_p, min_p, seed]
    (treespec.common.spec.sampling.as_tensors) and rejection flag, then the batch's filter width,
    an int: treespec.common.spec.sampling.filter_width)."""
    if sampling is None:
        return logits.float().log_softmax(-1), None, None, None
    k = logits.shape[1] if logits.dim() == 3 else 1
    if k == 1 or position.dim() == 2:       # a position a row
        pos = position.reshape(-1)
    else:
        pos = position.repeat_interleave(k)
    rows = sampling[:6] if k == 1 else [x.repeat_interleave(k) for x in sampling[:6]]
    params, rejection = rows[:5], rows[5]
    lp, pick, cols, qi, qp = draft_scores(logits.reshape(-1, logits.shape[-1]), *params,
                                          pos, rejection, ids=ids, width=sampling[6])
    lead = logits.shape[:-1]
    return tuple(x.view(*lead, -1) for x in (lp, pick)) + (
        (qi.view(*lead, -1), qp.view(*lead, -1)), cols.view(*lead, -1))


def greedy_chain(first: torch.Tensor, depth: int, ctx: torch.Tensor, table: torch.Tensor,
                 block_size: int, forward: Callable[[ForwardBatch], torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chain of depth tokens (greedy, or sampled: forward chooses): first [B] (level
    1, at position ctx), then each level's token forward(fb) [B] after its parent, fb
    one token a row at slot and position ctx + level - 1 (after the committed units
    and the chain's earlier levels). Returns tokens, parents [B, depth] int32 and
    chunk_pos [B, depth] (where each node's KV sits after ctx; -1 for the last, never
    forwarded): what ``expand`` returns for a chain."""
    b, dev = first.shape[0], first.device
    tokens = [first]
    if depth > 1:    # every level's batch but its tokens, at once: [level, B] rows are views
        pos = ctx.long().unsqueeze(1) + torch.arange(depth - 1, device=dev)      # [B, D - 1]
        slots = device_slots(table, pos, block_size).T.contiguous()
        pos = pos.T.contiguous()
        lens = pos.to(torch.int32)
        cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32)
        last = torch.arange(b, device=dev)
        alone = torch.full((b,), -1, dtype=torch.int32, device=dev)     # sees the context
    for level in range(1, depth):
        tokens.append(forward(ForwardBatch(tokens[-1].long(), pos[level - 1], slots[level - 1],
                                           table, lens[level - 1], cu_q, alone, last)))
    at = torch.arange(depth, device=dev)
    return (torch.stack(tokens, 1).to(torch.int32), (at - 1).to(torch.int32).expand(b, depth),
            torch.where(at < depth - 1, at, -1).expand(b, depth))


class SampledChain:
    """A sampled chain's choice at each level (greedy_chain's forward ends in it): the
    child is the level's first pick (treespec.common.spec.sampling.draft_scores), whose q it keeps.
    A chain's rerank is its depth order whatever the scores, so nothing else is kept."""

    def __init__(self, sampling: list[torch.Tensor], ids: torch.Tensor | None = None) -> None:
        self.sampling, self.ids, self.q = sampling, ids, []

    def __call__(self, logits: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """logits [B, V] of the tokens at position [B] -> the chosen columns [B]."""
        _, pick, q, cols = scores(logits, self.sampling, position, self.ids)
        self.q.append(q)
        return cols.gather(-1, pick.argmax(-1, keepdim=True)).squeeze(-1)

    def qs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The levels' q_ids, q_probs [B, depth, Q]."""
        return tuple(torch.stack(x, 1) for x in zip(*self.q))


def expand(net: Qwen3Model, cache: PagedKVCache, ops: ModuleType, env: TreeEnvelope,
           depths: list[torch.Tensor], root_logits: torch.Tensor, ctx: torch.Tensor,
           table: torch.Tensor, sampling: list[torch.Tensor] | None = None
           ) -> tuple[torch.Tensor, ...]:
    """root_logits [B, V] the root's next-token logits (the model's dtype), ctx [B]
    int32 draft kv_len (the root's KV written: level-1 tokens sit at position ctx),
    table [B, P] int32 -> tokens, parents [B, N] int32, chunk_pos [B, N] (and,
    sampling, q_ids, q_probs [B, N, Q])."""
    b = root_logits.shape[0]
    if sampling is None and env.topk == 1:
        return greedy_chain(root_logits.argmax(-1), env.depth, ctx, table, cache.block_size,
                            lambda fb: net.greedy(net(fb, cache, ops)[0], ops))
    if env.topk == 1:
        pick = SampledChain(sampling)
        out = greedy_chain(pick(root_logits, ctx), env.depth, ctx, table, cache.block_size,
                           lambda fb: pick(ops.linear(net(fb, cache, ops)[0], net.lm_head.weight),
                                           fb.positions + 1))
        return (*out, *pick.qs())
    lp, pick, q, cols = scores(root_logits, sampling, ctx)
    exp = Expansion(lp, env.topk, env.depth, pick, q,
                    static=None if sampling is None else sampling[0] > 0, root_cols=cols)
    for level in range(1, env.depth):
        tok, par, _ = exp.chunk(level)                                    # [B, level*K]
        fb = device_forward_batch(tok, par, depths[level - 1], ctx, table, cache.block_size)
        hidden, _ = net(fb, cache, ops)                                   # [B*level*K, H]
        newest = hidden.view(b, level * env.topk, -1)[:, (level - 1) * env.topk:]
        logits = ops.linear(newest.reshape(b * env.topk, -1), net.lm_head.weight)
        exp.grow(level, *scores(logits.view(b, env.topk, -1), sampling, ctx + level))
    return exp.rerank(env.num_nodes)


def catch_up_and_expand(net: Qwen3Model, cache: PagedKVCache, ops: ModuleType,
                        env: TreeEnvelope, depths: list[torch.Tensor], tokens: torch.Tensor,
                        count: torch.Tensor, ctx0: torch.Tensor, table: torch.Tensor,
                        sampling: list[torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, ...]:
    """tokens [B, C] int64 whose first count[b] (>= 1) are row b's uncommitted
    tokens, ctx0 [B] int32 the draft KV length before them, table [B, P] int32
    covering ctx0 + C + the expansion's scratch -> expand's outputs. The tail past
    count[b] is padding: it sees only itself, nobody sees it, and the slots it
    writes lie past the committed length (the expansion overwrites or never reads
    them)."""
    b, c = tokens.shape
    fb = padded_chain_batch(tokens, count, ctx0, table, cache.block_size)
    hidden, _ = net(fb, cache, ops)                                              # [B*C, H]
    last = hidden.view(b, c, -1)[torch.arange(b, device=tokens.device), count.long() - 1]
    return expand(net, cache, ops, env, depths, ops.linear(last, net.lm_head.weight),
                  ctx0 + count, table, sampling)
