"""EAGLE-2 style tree expansion and reranking over a batch, as tensor bookkeeping.

The draft model runs outside this module; this one decides which nodes to
forward and which to emit. Every candidate gets an id in a fixed space of
``M = topk + (depth - 1) * topk^2`` (level 1 first, then topk^2 per level), so
shapes never depend on the data:

* level 1: the ``topk`` best tokens after the root (ids 0 .. K-1);
* level d + 1: each of the K *frontier* nodes of level d gets its K best
  children, cumulative log-prob = parent's + child's; the best K of those K*K
  become the next frontier. Frontier nodes of levels 1 .. depth-1 are what the
  draft forwards: one tree chunk holding all of them, frontier of level l at
  chunk positions ``(l-1)*K .. l*K - 1``;
* a row that samples (treespec.common.spec.sampling.draft_scores) chooses each node's K children
  by their picks, the log-probs plus the Gumbel noise the target draws with: a draw
  without replacement whose first child is the target's draw wherever the two
  models agree. Such a row is *static*: its i-th child (in pick order) scores
  ``ln 0.8 + i ln 0.2`` whatever its token, so the tree's shape never depends on
  what was drawn (rejection sampling, treespec.kernels.reference.rejection_walk, needs that; coupled
  acceptance gains by it, since the first picks are the likeliest accepted): a
  main chain of first children, later siblings where they fit. Each node keeps the
  q its siblings were drawn from (``q_ids``, ``q_probs``) when given;
* rerank: the best ``num_nodes`` candidates by cumulative log-prob. A child
  never outscores its parent (log-probs are <= 0) and ties go to the lower id,
  which is the shallower node, so the kept set is ancestor-closed and its
  best-first order is topological.

Example, topk 2, depth 2 (M = 6), num_nodes 3, root log-probs a: -0.1, b: -1.0::

    level 1:  a(0) -0.1   b(1) -1.0              frontier = [a, b], chunk = [a, b]
    level 2:  a→c(2) -0.3  a→d(3) -2.1  b→e(4) -1.2  b→f(5) -3.0
    rerank:   a -0.1, c -0.3, b -1.0  -> tokens [a, c, b], parents [-1, 0, -1]
"""

from __future__ import annotations

import math

import torch


class Expansion:
    """All candidates of one expansion, for a batch of B sequences.

    tokens [B, M] int64, scores [B, M] float32 cumulative log-probs, parents
    [B, M] int64 candidate id (-1 = root), chunk_pos [B, M] int64 position in
    the expansion chunk (-1 = never forwarded), frontier [B, K] newest frontier.
    """

    def __init__(self, root_logp: torch.Tensor, topk: int, depth: int,
                 root_pick: torch.Tensor | None = None,
                 root_q: tuple[torch.Tensor, torch.Tensor] | None = None,
                 static: torch.Tensor | None = None,
                 root_cols: torch.Tensor | None = None) -> None:
        """root_q: the root's q (ids, probs) [B, Q]; static [B] bool: sampling rows;
        root_cols [B, W]: the token of each column of root_logp and root_pick (their
        columns are the vocabulary's when not given)."""
        b, dev = root_logp.shape[0], root_logp.device
        self.static = static
        k = self.topk = topk
        self.depth = depth
        m = k + (depth - 1) * k * k
        self.tokens = torch.zeros(b, m, dtype=torch.long, device=dev)
        self.scores = torch.full((b, m), float("-inf"), device=dev)
        self.parents = torch.full((b, m), -1, dtype=torch.long, device=dev)
        self.chunk_pos = torch.full((b, m), -1, dtype=torch.long, device=dev)
        self.chunk_ids = torch.zeros(b, (depth - 1) * k, dtype=torch.long, device=dev)
        self._chunk_at = torch.arange((depth - 1) * k, device=dev)
        self.q = None
        if root_q is not None:
            self.q = [x.new_zeros((b, m, x.shape[-1])) for x in root_q]     # [B, M, Q]
            for mine, x in zip(self.q, root_q):
                mine[:, :k] = x.unsqueeze(1)
        lp, tok = self._top(root_logp, root_pick, k, root_cols)         # [B, K]
        self.tokens[:, :k] = tok
        self.scores[:, :k] = _clean(lp)
        self.frontier = torch.arange(k, device=dev).expand(b, k)        # [B, K]
        if depth > 1:
            self._enter_chunk(1, self.frontier)

    def _enter_chunk(self, level: int, ids: torch.Tensor) -> None:
        b, k = ids.shape
        at = slice((level - 1) * k, level * k)
        self.chunk_ids[:, at] = ids
        self.chunk_pos.scatter_(1, ids, self._chunk_at[at].expand(b, k))

    def chunk(self, level: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The tree chunk of frontier levels 1 .. level.

        Returns tokens [B, level*K], chunk-local parents [B, level*K] (-1 = a
        root child, which sees only the context) and depth offsets [level*K]
        (0 for level 1: positions are kv_len + level - 1).
        """
        ids = self.chunk_ids[:, :level * self.topk]
        tok = self.tokens.gather(1, ids)
        par = self.parents.gather(1, ids)
        cpar = torch.where(par >= 0, self.chunk_pos.gather(1, par.clamp(min=0)), -1)
        return tok, cpar, [lv for lv in range(level) for _ in range(self.topk)]

    def grow(self, level: int, logp: torch.Tensor, pick: torch.Tensor | None = None,
             q: tuple[torch.Tensor, torch.Tensor] | None = None,
             cols: torch.Tensor | None = None) -> None:
        """Add level + 1 from logp [B, K, V], the next-token log-probs of the
        level-`level` frontier (chunk positions (level-1)*K .. level*K - 1); pick
        (same shape) chooses the children when given (treespec.common.spec.sampling.draft_scores),
        else the log-probs do; q (ids, probs) [B, K, Q] each frontier node's q; cols
        (same shape as logp): the token of each column, when not the vocabulary's."""
        b, k = self.frontier.shape
        lp, tok = self._top(logp, pick, k, cols)                        # [B, K, K]
        score = self.scores.gather(1, self.frontier).unsqueeze(-1) + _clean(lp)
        start = k + (level - 1) * k * k
        ids = slice(start, start + k * k)                               # this level's
        self.tokens[:, ids] = tok.reshape(b, k * k)
        self.scores[:, ids] = score.reshape(b, k * k)
        self.parents[:, ids] = self.frontier.unsqueeze(-1).expand(b, k, k).reshape(b, k * k)
        if self.q is not None and q is not None:
            for mine, x in zip(self.q, q):          # siblings share their parent's q
                mine[:, ids] = x.unsqueeze(2).expand(-1, -1, k, -1).reshape(b, k * k, -1)
        if level + 1 < self.depth:
            self.frontier = score.reshape(b, k * k).topk(k, dim=-1).indices + start
            self._enter_chunk(level + 1, self.frontier)

    def rerank(self, num_nodes: int) -> tuple[torch.Tensor, ...]:
        """The best num_nodes candidates, best first (a topological order).

        Returns tokens [B, N] int32, parents [B, N] int32 (-1 = root, else an
        earlier node) and chunk_pos [B, N] int64 of each emitted node, then (when
        given q) each node's q_ids, q_probs [B, N, Q].
        """
        b, _ = self.scores.shape
        keep = self.scores.sort(dim=1, descending=True, stable=True).indices[:, :num_nodes]
        pos_of = torch.full_like(self.parents, -1)
        pos_of.scatter_(1, keep, torch.arange(num_nodes, device=keep.device).expand(b, num_nodes))
        par = self.parents.gather(1, keep)
        parents = torch.where(par >= 0, pos_of.gather(1, par.clamp(min=0)), -1)
        out = (self.tokens.gather(1, keep).to(torch.int32), parents.to(torch.int32),
               self.chunk_pos.gather(1, keep))
        if self.q is None:
            return out
        at = keep.unsqueeze(-1).expand(-1, -1, self.q[0].shape[-1])
        return (*out, *(x.gather(1, at) for x in self.q))

    def _top(self, logp: torch.Tensor, pick: torch.Tensor | None, k: int,
             cols: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The k children by pick (by log-prob without one): their scores (a static
        row's by rank) and tokens (cols' where given, else the column indices)."""
        if pick is None:
            return logp.float().topk(k, dim=-1)
        at = pick.topk(k, dim=-1).indices
        lp = logp.float().gather(-1, at)
        tok = at if cols is None else cols.gather(-1, at)
        if self.static is None:
            return lp, tok
        rank = math.log(0.8) + math.log(0.2) * torch.arange(k, device=lp.device,
                                                             dtype=lp.dtype)
        static = self.static.view(-1, *[1] * (lp.dim() - 1))
        return torch.where(static, rank, lp), tok


def _clean(logp: torch.Tensor) -> torch.Tensor:
    """Log-probs that keep cumulative scores monotone: <= 0, NaN as -inf."""
    return logp.nan_to_num(nan=float("-inf")).clamp(max=0.0)
