"""The EAGLE-3 head's draft step at a fixed shape, entirely on the device (what its
CUDA graph holds: treespec.draft_service.draft_graphs.DraftGraphs).

``eagle3_step``: a [B, depth + 1] catch-up chain of committed pairs whose unused
tail is padding, then ``expand_eagle3``: depth - 1 tree chunks whose hidden inputs
are their parents' outputs, and the rerank (see eagle3_proposer for the alignment);
a chain forwards one node a level (model_step.greedy_chain).
"""

from __future__ import annotations

from types import ModuleType

import torch

from treespec.common.runtime.forward_batch import device_forward_batch, padded_chain_batch
from treespec.common.runtime.kv_cache import PagedKVCache
from treespec.common.spec.tree import TreeEnvelope
from treespec.draft_service.eagle3_head import Eagle3Head
from treespec.draft_service.model_step import SampledChain, greedy_chain, scores
from treespec.draft_service.tree_build import Expansion


def expand_eagle3(head: Eagle3Head, cache: PagedKVCache, ops: ModuleType, env: TreeEnvelope,
                  depths: list[torch.Tensor], root: torch.Tensor, ctx: torch.Tensor,
                  table: torch.Tensor, sampling: list[torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, ...]:
    """root [B, H]: the catch-up's output at each newest pair; ctx [B] int32
    committed pairs (the tree is scratch after them; level-1 tokens sit at token
    position ctx + 1); table [B, P] -> tokens, parents [B, N] (target ids) and, when
    sampling, q_ids (target ids), q_probs [B, N, Q]."""
    if sampling is None and env.topk == 1:
        out = root

        def forward(fb):        # a level's input hidden is its parent's output
            nonlocal out
            out = head(fb, cache, ops, out)
            return head.to_target(head.draft_logits(out, ops).argmax(-1))

        first = head.to_target(head.draft_logits(root, ops).argmax(-1))
        return greedy_chain(first, env.depth, ctx, table, cache.block_size, forward)[:2]
    ids = head.target_ids
    if env.topk == 1:           # a sampled chain: each level's first pick
        pick, out = SampledChain(sampling, ids), root

        def forward_sampled(fb):
            nonlocal out
            out = head(fb, cache, ops, out)
            return head.to_target(pick(head.logits(out, ops), fb.positions + 2))

        first = head.to_target(pick(head.logits(root, ops), ctx + 1))
        t, p, _ = greedy_chain(first, env.depth, ctx, table, cache.block_size, forward_sampled)
        return (t, p, *pick.qs())
    lp, pick, q, cols = scores(head.logits(root, ops), sampling, ctx + 1, ids)
    exp = Expansion(lp, env.topk, env.depth, pick, q,
                    static=None if sampling is None else sampling[0] > 0, root_cols=cols)
    b, k, hid = root.shape[0], env.topk, root.shape[-1]
    prev = root.new_zeros(b, 0, hid)               # [B, (level-1)*K, H] last chunk's outputs
    for level in range(1, env.depth):
        tok, par, _ = exp.chunk(level)                                  # [B, level*K]
        src = torch.cat([root.unsqueeze(1), prev], 1)                   # parent -1 = root
        hin = src.gather(1, (par + 1).unsqueeze(-1).expand(-1, -1, hid))
        fb = device_forward_batch(head.to_target(tok), par, depths[level - 1], ctx, table,
                                  cache.block_size)
        prev = head(fb, cache, ops, hin.view(b * level * k, hid)).view(b, level * k, hid)
        newest = prev[:, (level - 1) * k:]                              # [B, K, H]
        logits = head.logits(newest.reshape(b * k, -1), ops).view(b, k, -1)
        exp.grow(level, *scores(logits, sampling, ctx + 1 + level, ids))
    t, p, _, *q = exp.rerank(env.num_nodes)
    return (head.to_target(t), p, *q)


def eagle3_step(head: Eagle3Head, cache: PagedKVCache, ops: ModuleType, env: TreeEnvelope,
                depths: list[torch.Tensor], tokens: torch.Tensor, count: torch.Tensor,
                ctx0: torch.Tensor, table: torch.Tensor, feats: torch.Tensor,
                sampling: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """tokens [B, C] int64 and feats [B, C, H]: row b's first count[b] (>= 1) new
    pairs (token, projected target features), written from pair position ctx0[b] on; the
    tail is padding (it sees only itself and writes slots the expansion
    overwrites or never reads). table covers ctx0 + C + the tree's scratch."""
    b, c = tokens.shape
    fb = padded_chain_batch(tokens, count, ctx0, table, cache.block_size)
    out = head(fb, cache, ops, feats.reshape(b * c, -1))                        # [B*C, H]
    root = out.view(b, c, -1)[torch.arange(b, device=tokens.device), count.long() - 1]
    return expand_eagle3(head, cache, ops, env, depths, root, ctx0 + count, table, sampling)
