"""The ``dflash`` method: a DFlash drafter (draft_service/dflash_head.py) drafts a whole
block of positions in one forward.

A FeatureDrafter (draft_service/feature_drafter.py): unit t is the committed pair
``(s_{t+1}, f_t)``, and its KV is the context K/V of ``f_t`` at position t in every
layer. One step, batched over sequences, at a fixed shape (one CUDA-graph replay):

1. *context*: the new pairs' features (at least the last: a [B, depth + 1] chain
   whose tail is padding) become context K/V at their positions, with no attention;
2. *block*: ``[s_n, mask x (B - 1)]`` at positions n .. n + B - 1 through the
   layers, its queries seeing the context and the whole block (chunk parents
   BLOCK), its own K/V written as scratch after the context (a later step's
   context overwrites it);
3. *tree*: the marginals of block positions 1 .. depth. A chain takes each
   position's best (a sampling row's first pick). A tree is the best num_nodes paths
   over each position's top-k, scored all at once (the block drafts positions, not
   paths, so every node of level l chooses among the same candidates of position
   l + 1): by summed log-prob, or for a sampling row by pick rank as
   tree_build.Expansion scores one, its picks drawn as the other model drafters draw
   them (treespec.common.spec.sampling.draft_scores, keyed by the position).

Rollback is free, as for EAGLE-3: only committed pairs' K/V is ever kept.
"""

from __future__ import annotations

import functools
import itertools
import math
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from treespec.common.runtime.forward_batch import device_forward_batch, padded_chain_batch
from treespec.common.runtime.kv_cache import PagedKVCache
from treespec.common.model.paths import resolve_model
from treespec.common.spec.tree import TreeEnvelope, shallower
from treespec.common.spec.vocab_top import CHUNK, top_k
from treespec.draft_service.dflash_head import DFlashHead
from treespec.draft_service.feature_drafter import FeatureDrafter, FeatureSeq
from treespec.draft_service.model_step import scores
from treespec.kernels.dispatch import select
from treespec.kernels.reference import BLOCK

if TYPE_CHECKING:
    from treespec.draft_service.config import DraftConfig


class DFlashProposer(FeatureDrafter):
    name = "dflash"
    levels = True           # a shallower tree: the LM head on that many block positions

    def __init__(self, head: DFlashHead, env: TreeEnvelope, ops: ModuleType,
                 num_blocks: int, block_size: int, model_name: str = "",
                 prefix_caching: bool = True) -> None:
        spec = head.spec
        if env.depth > spec.block_size - 1:
            raise ValueError(f"envelope {env.name} is {env.depth} deep, but a DFlash block "
                             f"of {spec.block_size} drafts {spec.block_size - 1} positions")
        self.head = head
        self.vocab_size = spec.layers.vocab_size
        self.target_hidden_layers = spec.capture_layers
        dev = head.device
        self._parents = torch.full((1, spec.block_size), BLOCK, dtype=torch.int32, device=dev)
        self._depths = torch.arange(spec.block_size, device=dev)
        prefix = f"{self.name}|{model_name}|{head.spec!r}" if prefix_caching else None
        super().__init__(head.new_cache(num_blocks, block_size, prefix), env, ops, model_name,
                         [((self.feature_size,), head.dtype)])
        self._scratch = max(self._scratch, spec.block_size)     # the block after the context

    @classmethod
    def load(cls, cfg: DraftConfig, device: torch.device, dtype: torch.dtype) -> DFlashProposer:
        head = DFlashHead.from_pretrained(resolve_model(cfg.model), cfg.target_embeddings,
                                          dtype, device)
        return cls(head, cfg.envelope, select(device, cfg.kernels), cfg.num_blocks,
                   cfg.block_size, model_name=cfg.model, prefix_caching=cfg.prefix_caching)

    # ------------------------------------------------------------ KVDrafter hooks
    def _prefill(self, rows: list[tuple[FeatureSeq, int, int]]) -> None:
        positions = np.concatenate([np.arange(lo, hi) for _, lo, hi in rows])
        slots = np.concatenate([self.cache.slots(st.pages, lo, hi) for st, lo, hi in rows])
        dev = self.head.device
        self.head.write_context(torch.cat([st.feats.rows[lo:hi] for st, lo, hi in rows]),
                                torch.from_numpy(positions).to(dev),
                                torch.from_numpy(slots).to(dev), self.cache, self.ops)

    def _step_fn(self, tokens: torch.Tensor, count: torch.Tensor, ctx0: torch.Tensor,
                 table: torch.Tensor, feats: torch.Tensor,
                 sampling: list[torch.Tensor] | None = None, depth: int = 0
                 ) -> tuple[torch.Tensor, ...]:
        """depth: the verify's (0: the envelope's): the block's forward is the same,
        the LM head and the tree take only positions 1 .. depth."""
        return dflash_step(self.head, self.cache, self.ops,
                           shallower(self.env, depth or self.env.depth), self._parents,
                           self._depths, tokens, count, ctx0, table, feats, sampling)


def dflash_step(head: DFlashHead, cache: PagedKVCache, ops: ModuleType, env: TreeEnvelope,
                parents: torch.Tensor, depths: torch.Tensor, tokens: torch.Tensor,
                count: torch.Tensor, ctx0: torch.Tensor, table: torch.Tensor,
                feats: torch.Tensor, sampling: list[torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, ...]:
    """tokens [B, C] int64 and feats [B, C, H] (projected): row b's first count[b]
    (>= 1) new pairs, written from position ctx0[b] on (the tail is padding: its slots
    are the block's, rewritten next); parents [1, block] BLOCK and depths [block];
    table covers ctx0 + count + block -> tokens, parents [B, N] (and, sampling, q_ids,
    q_probs [B, N, Q])."""
    b, c = tokens.shape
    spec = head.spec
    chain = padded_chain_batch(tokens, count, ctx0, table, cache.block_size)
    head.write_context(feats.reshape(b * c, -1), chain.positions, chain.slots, cache, ops)
    n = ctx0 + count                                       # the root's position
    root = tokens.gather(1, (count.long() - 1).unsqueeze(1))                   # [B, 1]
    block = torch.cat([root, torch.full((b, spec.block_size - 1), spec.mask_token_id,
                                        dtype=root.dtype, device=root.device)], 1)
    par = parents.expand(b, -1)
    fb = device_forward_batch(block, par, depths, n.to(torch.int32), table, cache.block_size)
    fb.ancestors = ops.tree_ancestors(par)
    hidden = head.block(fb, cache, ops).view(b, spec.block_size, -1)[:, 1:env.depth + 1]
    logits = head.logits(hidden.reshape(b * env.depth, -1), ops).view(b, env.depth, -1)
    return block_tree(logits, env, n, sampling, ops)


def block_tree(logits: torch.Tensor, env: TreeEnvelope, n: torch.Tensor,
               sampling: list[torch.Tensor] | None, ops: ModuleType
               ) -> tuple[torch.Tensor, ...]:
    """The envelope's tree from the marginals logits [B, depth, V] of positions n + 1 ..
    n + depth: tokens, parents [B, N] (and, sampling, q_ids, q_probs [B, N, Q])."""
    if sampling is None:
        return _greedy_tree(logits, env, ops)
    k = env.topk

    # every position's scores in one batch: the block drafted them all at once
    at = n.long().unsqueeze(1) + 1 + torch.arange(env.depth, device=logits.device)
    lp, pick, q, cols = scores(logits, sampling, at)                         # [B, D, ...]
    if k == 1:                  # a chain: each position's first pick, in depth order
        b = at.shape[0]
        tokens = cols.gather(-1, pick.argmax(-1, keepdim=True)).squeeze(-1)[:, :env.num_nodes]
        parents = torch.arange(-1, tokens.shape[1] - 1, device=at.device, dtype=torch.int32)
        return (tokens.to(torch.int32), parents.expand(b, -1),
                *(x[:, :env.num_nodes] for x in q))
    # a sampling row's i-th pick scores ln 0.8 + i ln 0.2 whatever its token, as in
    # tree_build.Expansion: its tree's shape never depends on what was drawn
    b, d, dev = lp.shape[0], env.depth, logits.device
    top = pick.topk(k, -1).indices                                          # [B, D, k]
    rank = math.log(0.8) + math.log(0.2) * torch.arange(k, device=dev)
    cost = torch.where((sampling[0] > 0).view(-1, 1, 1), -rank, -lp.float().gather(-1, top))
    last, parents = _best_paths(cost, env.num_nodes)
    level = (last // k).unsqueeze(-1)           # a node's q: its position's, its siblings'
    return (cols.gather(-1, top).view(b, d * k).gather(1, last).to(torch.int32), parents,
            *(x.gather(1, level.expand(-1, -1, x.shape[-1])) for x in q))


def _greedy_tree(logits: torch.Tensor, env: TreeEnvelope, ops: ModuleType
                 ) -> tuple[torch.Tensor, ...]:
    """block_tree of a batch that does not sample, in a fixed handful of ops: a chain is
    the argmax of every position; a tree is _best_paths by summed log-prob."""
    b, d, _ = logits.shape
    k, dev = env.topk, logits.device
    if k == 1:
        return (logits.argmax(-1).to(torch.int32),
                (torch.arange(d, device=dev, dtype=torch.int32) - 1).expand(b, d))
    flat = logits.reshape(b * d, -1)
    lse, maxima = ops.vocab_stats(flat, CHUNK)              # no log-probability tensor
    top, ids = top_k(flat, k, maxima)
    last, parents = _best_paths(-(top.float() - lse.unsqueeze(1)).view(b, d, k), env.num_nodes)
    return ids.view(b, d * k).gather(1, last).to(torch.int32), parents


def _best_paths(cost: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best num_nodes of every path that leaves each position's choice 0 at most
    DEVIATIONS times, by summed cost (cost [B, D, k] of each position's k choices; the
    block drafts positions, not paths, so a path's cost is its positions' sum and no
    level waits on the last), best first: each one's last choice as a column of
    [D * k] and its parent's index (-1: the root) [B, N]."""
    b, d, k = cost.shape
    cols, parent, last = _paths(d, k, cost.device)                          # [M, D], [M], [M]
    flat = torch.cat([cost.nan_to_num(nan=float("inf")).clamp(min=0).view(b, d * k),
                      cost.new_zeros(b, 1)], 1)                             # [B, D*k + 1]
    # each path's costs in one row (0 past its end): a child's row is its parent's plus
    # one cost >= 0, so it never outscores its parent and, tied, sorts after it
    score = -flat[:, cols].sum(-1)                                          # [B, M]
    keep = score.sort(dim=1, descending=True, stable=True).indices[:, :num_nodes]
    pos_of = torch.full_like(score, -1, dtype=torch.long).scatter_(
        1, keep, torch.arange(num_nodes, device=cost.device).expand(b, num_nodes))
    par = parent[keep]
    parents = torch.where(par >= 0, pos_of.gather(1, par.clamp(min=0)), -1)
    return last[keep], parents.to(torch.int32)


DEVIATIONS = 2


@functools.lru_cache(maxsize=16)
def _paths(depth: int, k: int, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every path of 1 .. depth positions taking each position's argmax (choice 0) but
    at most DEVIATIONS times one of its other top-k, shortest first, then those that
    leave it later first (tied, they win: as in tree_build.Expansion, where the
    cheaper parent's children come first): for each, the
    column of each position's choice in a flat [depth * k + 1] cost table (depth * k,
    the zero, past the path's end), its parent's index (-1: the root's child) and its
    last choice's column, on device (made once, before any graph capture: the warm-up
    runs first)."""
    index: dict[tuple[int, ...], int] = {}
    for length in range(1, depth + 1):
        for dev in itertools.chain.from_iterable(
                itertools.combinations(range(length - 1, -1, -1), m)
                for m in range(DEVIATIONS + 1)):
            for picks in itertools.product(range(1, k), repeat=len(dev)):
                path = [0] * length
                for at, c in zip(dev, picks):
                    path[at] = c
                index[tuple(path)] = len(index)
    paths = list(index)
    cols = torch.tensor([[i * k + c for i, c in enumerate(p)] + [depth * k] * (depth - len(p))
                         for p in paths])
    parent = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths])
    last = torch.tensor([(len(p) - 1) * k + p[-1] for p in paths])
    return cols.to(device), parent.to(device), last.to(device)
