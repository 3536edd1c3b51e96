"""Prompt-lookup drafting: continue the sequence the way it continued before.

Like vLLM's NgramProposer and HF prompt lookup, but tree shaped: the last n
tokens (n from ngram_max down to ngram_min) are looked up among their earlier
occurrences, and the continuations after those occurrences (longer n first,
then most recent first) are merged into a trie. Distinct continuations become
sibling branches (at most ``topk`` children a node), paths stop at ``depth``,
and the trie stops growing at ``num_nodes``; the rest is padding.

Example, envelope depth 3, topk 2, N 6, tokens ``1 2 3 4 9 1 2 3 5 7 1 2 3``:
the suffix ``1 2 3`` occurred twice before, followed by ``5 7 1`` (most recent)
and ``4 9 1``::

    root ─ 5(0) ─ 7(1) ─ 1(2)        tokens  = [5, 7, 1, 4, 9, 1]
         └ 4(3) ─ 9(4) ─ 1(5)        parents = [-1, 0, 1, -1, 3, 4]

A chain envelope (topk 1) keeps the first continuation only (longer matches
that share its prefix may still extend it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from treespec.common.spec.tree import PAD, ROOT, TreeBatch, TreeEnvelope
from treespec.draft_service.ngram_index import NgramIndex

if TYPE_CHECKING:
    from treespec.draft_service.config import DraftConfig


def merge_paths(paths: Iterable[list[int]], env: TreeEnvelope) -> tuple[list[int], list[int]]:
    """Merge token paths, in priority order, into a trie within the envelope.

    Returns (tokens, parents) of length env.num_nodes, in creation order (so a
    parent always precedes its child), padded with token 0 / parent -2.
    """
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}     # (parent node, token) -> node
    fanout: dict[int, int] = {}                # node -> children so far
    for path in paths:
        cur = ROOT
        for tok in path[:env.depth]:
            nxt = child.get((cur, tok))
            if nxt is None:
                if len(tokens) == env.num_nodes or fanout.get(cur, 0) == env.topk:
                    break
                nxt = len(tokens)
                tokens.append(tok)
                parents.append(cur)
                child[(cur, tok)] = nxt
                fanout[cur] = fanout.get(cur, 0) + 1
            cur = nxt
        if len(tokens) == env.num_nodes:
            break
    pad = env.num_nodes - len(tokens)
    return tokens + [0] * pad, parents + [PAD] * pad


class NgramProposer:
    """The ``ngram`` method: one NgramIndex per sequence, no model, any vocabulary."""

    name = "ngram"
    light = True
    lookahead = True            # update() takes guessed tokens back (draft_service/lookahead.py)
    vocab_size = 0
    target_hidden_layers: tuple[int, ...] = ()
    model = ""

    @classmethod
    def from_config(cls, cfg: DraftConfig) -> NgramProposer:
        return cls(cfg)

    def __init__(self, cfg: DraftConfig) -> None:
        self.env = cfg.envelope
        self.n_min, self.n_max = cfg.ngram_min, cfg.ngram_max
        self.per_n = max(16, 2 * self.env.num_nodes)
        self._index: dict[int, NgramIndex] = {}

    def update(self, seq_id: int, tokens: list[int], new_count: int,
               accepted_nodes: list[int], hidden: torch.Tensor | None) -> None:
        index = self._index.get(seq_id)
        old = len(tokens) - new_count
        if index is not None and len(index) > old:     # a lookahead's guesses, taken back
            index.truncate(old)
        if index is None or len(index) != old:
            index = self._index[seq_id] = NgramIndex(self.n_min, self.n_max)
            new_count = len(tokens)
        index.extend(tokens[len(tokens) - new_count:])

    def propose(self, seq_ids: list[int], sampling=None) -> TreeBatch:
        rows_t, rows_p = [], []
        d = self.env.depth
        for s in seq_ids:
            index = self._index[s]
            toks = index.tokens
            t, p = merge_paths((toks[m:m + d] for m in index.matches(self.per_n)), self.env)
            rows_t.append(t)
            rows_p.append(p)
        shape = (len(seq_ids), self.env.num_nodes)
        return TreeBatch(torch.tensor(rows_t, dtype=torch.int32).view(shape),
                         torch.tensor(rows_p, dtype=torch.int32).view(shape))

    def release(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)
