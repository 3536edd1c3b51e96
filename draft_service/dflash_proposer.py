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

Lookahead (draft_service/lookahead.py): a guessed token has no target feature, and the
block has no output of its own to put in its place (zero features: no hit in a CPU
trial), so guessed tokens stay out of the context and go *into the block*. A candidate
sits at an accepted depth d the sequence reached often lately (partial acceptance): over
the committed context, ``[s_n, path[:d], mask ...]`` gives its guess, the block's best
token at d + 1 that the tree did not try there, and ``[s_n, path[:d], guess, mask ...]``
its tree from the positions after the guess (two eager block forwards per candidate
rank, batched over sequences). The block must hold the path, the guess and a tree: an
envelope at most (block_size - 2) / 2 deep (block8 of a 16-block drafter, not block16).
"""

from __future__ import annotations

import functools
import itertools
import math
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from treespec.common.runtime.block_manager import OutOfPages
from treespec.common.runtime.forward_batch import device_forward_batch, padded_chain_batch
from treespec.common.runtime.kv_cache import PagedKVCache
from treespec.common.model.paths import resolve_model
from treespec.common.spec import sampling_batch
from treespec.common.spec.sampling import GREEDY
from treespec.common.spec.sampling_batch import SamplingBatch
from treespec.common.spec.tree import ROOT, TreeBatch, TreeEnvelope, shallower
from treespec.common.spec.vocab_top import CHUNK, top_k
from treespec.draft_service.dflash_head import DFlashHead
from treespec.draft_service.draft_graphs import per_row
from treespec.draft_service.feature_drafter import FeatureDrafter, FeatureSeq
from treespec.draft_service.lookahead import Row, likely_nodes
from treespec.draft_service.model_step import scores
from treespec.kernels.dispatch import select
from treespec.kernels.reference import BLOCK

if TYPE_CHECKING:
    from treespec.draft_service.config import DraftConfig


# lookahead: the weight of a step's outcome in a sequence's moving depth frequencies
OUTCOME_WEIGHT = 1 / 4


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
        self._outcomes: dict[int, list[float]] = {}     # lookahead: each sequence's depths

    @classmethod
    def load(cls, cfg: DraftConfig, device: torch.device, dtype: torch.dtype) -> DFlashProposer:
        head = DFlashHead.from_pretrained(resolve_model(cfg.model), cfg.target_embeddings,
                                          dtype, device)
        return cls(head, cfg.envelope, select(device, cfg.kernels), cfg.num_blocks,
                   cfg.block_size, model_name=cfg.model, prefix_caching=cfg.prefix_caching)

    @property
    def lookahead(self) -> bool:
        """Whether it pre-drafts: its block holds a path, a guess and a tree (module doc)."""
        return 2 * self.env.depth + 2 <= self.head.spec.block_size

    def draft_candidates(self, rows: list[Row], per_seq: int) -> tuple[torch.Tensor, TreeBatch]:
        """lookahead.draft_candidates by the block (module doc): (keys [B * K, depth + 1],
        trees [B * K, N]), K = per_seq, at the K accepted depths the sequence reached
        most often lately; a row whose committed pairs lack KV (dropped for pages) gets
        none. The drafter's state is left as it was."""
        keys = torch.full((len(rows) * per_seq, self.env.depth + 1), -1, dtype=torch.int32)
        trees = TreeBatch.padding(len(rows) * per_seq, self.env.num_nodes)
        ranks: list[list[tuple]] = [[] for _ in range(per_seq)]   # (row, path, tried there)
        for b, r in enumerate(rows):
            if not self._ready(r):
                continue
            nodes = likely_nodes(r.tree_parents)
            seen = self._outcomes.setdefault(r.seq_id, [0.0] * (self.env.depth + 1))
            for k, d in enumerate(sorted(range(len(nodes) + 1), key=lambda d: -seen[d])[:per_seq]):
                at = nodes[d - 1] if d else ROOT
                ranks[k].append((b, [r.tree_tokens[i] for i in nodes[:d]],
                                 {t for t, p in zip(r.tree_tokens, r.tree_parents) if p == at}))
        wide = self.env.topk + 1        # the guess: the best token the tree did not try there
        for k, cands in enumerate(ranks):   # a block's scratch is its sequence's: a rank a time
            if not cands:
                break
            probe = self._after([rows[b] for b, _, _ in cands], [path for _, path, _ in cands],
                                TreeEnvelope(1, wide, wide))
            keyed = [(b, path + [next(t for t in tops if t not in tried)])
                     for (b, path, tried), tops in zip(cands, probe.tokens.tolist())]
            got = self._after([rows[b] for b, _ in keyed], [key for _, key in keyed], self.env)
            for i, (b, key) in enumerate(keyed):
                keys[b * per_seq + k, :len(key)] = torch.tensor(key, dtype=torch.int32)
                trees.tokens[b * per_seq + k] = got.tokens[i]
                trees.parents[b * per_seq + k] = got.parents[i]
        return keys, trees

    def update(self, seq_id: int, tokens: list[int], new_count: int,
               accepted_nodes: list[int], hidden: torch.Tensor | None) -> None:
        super().update(seq_id, tokens, new_count, accepted_nodes, hidden)
        seen = self._outcomes.get(seq_id)
        if seen is not None and new_count < len(tokens):    # a step's outcome: its depth
            d = min(new_count - 1, len(seen) - 1)
            for i in range(len(seen)):
                seen[i] += OUTCOME_WEIGHT * ((i == d) - seen[i])

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self._outcomes.pop(seq_id, None)

    def _ready(self, r: Row) -> bool:
        """Whether r's sequence holds KV of its committed pairs, but for at most a step's
        (those of a hit, which drafted nothing), and pages for a block."""
        st = self._seqs.get(r.seq_id)
        units = len(r.tokens) - 1
        if st is None or st.tokens != r.tokens \
                or not 0 <= units - st.pages.kv_len < self.graphs.catch_up_len:
            return False
        try:
            self.cache.reserve(st.pages, units + self._scratch)
        except OutOfPages:
            return False
        return True

    @torch.inference_mode()
    def _after(self, rows: list[Row], known: list[list[int]], env: TreeEnvelope) -> TreeBatch:
        """Each row's tree of env drafted after its committed tokens and known, one eager
        block forward (the pairs lacking KV, at least the newest, written first; a
        shared page is copied before it is written)."""
        sts = [self._seqs[r.seq_id] for r in rows]
        units = [len(st.tokens) - 1 for st in sts]
        lo = [min(st.pages.kv_len, u - 1) for st, u in zip(sts, units)]
        for st, start in zip(sts, lo):
            self.cache.rewind(st.pages, start)
        dev, b = self.head.device, len(rows)
        new = [self._inputs(st, start, u) for st, start, u in zip(sts, lo, units)]
        width = max(len(t) for t, _ in new)
        tokens = torch.zeros((b, width), dtype=torch.long)
        feats = torch.zeros((b, width, self.feature_size), dtype=self.head.dtype, device=dev)
        for i, (t, (f,)) in enumerate(new):
            tokens[i, :len(t)] = torch.tensor(t)
            feats[i, :len(t)] = f
        table = self.graphs.buckets.shape([st.pages for st in sts])[2][:b].to(dev)
        given = torch.full((b, max(map(len, known))), -1, dtype=torch.long)
        for i, k in enumerate(known):
            given[i, :len(k)] = torch.tensor(k)
        sampling = None
        if any(r.sampling is not None for r in rows):
            batch = SamplingBatch([r.sampling.params if r.sampling else GREEDY for r in rows])
            x = per_row(batch, [False] * b, b).to(dev)
            sampling = [*sampling_batch.unpack(x[:, :-1]), x[:, -1].bool(), batch.width]
        out = dflash_step(self.head, self.cache, self.ops, env, self._parents, self._depths,
                          tokens.to(dev), torch.tensor([len(t) for t, _ in new],
                                                       dtype=torch.int32, device=dev),
                          torch.tensor(lo, dtype=torch.int32, device=dev), table, feats,
                          sampling, given.to(dev))
        for st, u in zip(sts, units):
            st.pages.kv_len = u
        return TreeBatch(out[0].cpu(), out[1].cpu())

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
                feats: torch.Tensor, sampling: list[torch.Tensor] | None = None,
                known: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """tokens [B, C] int64 and feats [B, C, H] (projected): row b's first count[b]
    (>= 1) new pairs, written from position ctx0[b] on (the tail is padding: its slots
    are the block's, rewritten next); parents [1, block] BLOCK and depths [block];
    table covers ctx0 + count + block -> tokens, parents [B, N] (and, sampling, q_ids,
    q_probs [B, N, Q]). known [B, K] (lookahead; -1 past a row's own): tokens the block
    takes as given after the root, the tree drafted after them."""
    b, c = tokens.shape
    spec = head.spec
    chain = padded_chain_batch(tokens, count, ctx0, table, cache.block_size)
    head.write_context(feats.reshape(b * c, -1), chain.positions, chain.slots, cache, ops)
    n = ctx0 + count                                       # the root's position
    root = tokens.gather(1, (count.long() - 1).unsqueeze(1))                   # [B, 1]
    block = torch.cat([root, torch.full((b, spec.block_size - 1), spec.mask_token_id,
                                        dtype=root.dtype, device=root.device)], 1)
    if known is not None:
        block[:, 1:1 + known.shape[1]] = torch.where(known >= 0, known, spec.mask_token_id)
    par = parents.expand(b, -1)
    fb = device_forward_batch(block, par, depths, n.to(torch.int32), table, cache.block_size)
    fb.ancestors = ops.tree_ancestors(par)
    hidden = head.block(fb, cache, ops).view(b, spec.block_size, -1)
    if known is None:
        hidden = hidden[:, 1:env.depth + 1]
    else:                       # the tree's positions follow each row's given tokens
        given = (known >= 0).sum(1)
        at = given.unsqueeze(1) + 1 + torch.arange(env.depth, device=given.device)
        hidden = hidden.gather(1, at.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        n = n + given.to(n.dtype)
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
