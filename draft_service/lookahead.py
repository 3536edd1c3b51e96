"""Lookahead: a sequence's next trees, drafted while the verify service verifies this one.

After answering a step, the draft guesses how the step will end for each sequence and
drafts the next step's tree for each guess, so that when the verify service finds its
outcome among the guesses, the next step needs no drafting on its critical path (the
verify picks the candidate itself and says which it took: ``SeqUpdate.lookahead_hit``).
A miss costs what a step costs without lookahead.

An outcome is what a step commits: the tree's accepted path, then the target's bonus
token. The guesses, per sequence of a tree of depth D (K = candidates per sequence):

* the path: the first deepest root-to-leaf path in node order (drafters emit nodes
  best first, so this is the drafter's most likely full acceptance);
* the bonus: a *probe* tree drafted as if the path were committed: its first K
  level-one nodes are the drafter's best guesses of the next token (with coupled
  sampling the drafter draws them with the target's seeded noise);
* candidate k: a tree drafted as if path + guess k were committed.

That is K + 1 batched draft steps a step, each catching up at most D + 1 units, all
while the target verifies. The proposer's state is then set back to the committed
tokens (``update`` with no new tokens: drafters roll their KV back to the committed
length, pages stay reserved for the sequence), so a hit or a miss starts from the same
state as a step without lookahead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespec.common.spec.tree import PAD, ROOT, TreeBatch
from treespec.draft_service.proposer import Proposer, RowSampling


@dataclass
class Row:
    """A sequence to pre-draft for: its committed tokens and the tree it is verified
    with this step."""

    seq_id: int
    tokens: list[int]
    tree_tokens: list[int]
    tree_parents: list[int]
    sampling: RowSampling | None


def likely_path(tokens: list[int], parents: list[int]) -> list[int]:
    """Tokens of the first deepest root-to-leaf path (node order breaks ties)."""
    depth: list[int] = []
    best = -1
    for i, p in enumerate(parents):
        if p == PAD:
            depth.append(-1)
            continue
        depth.append(1 if p == ROOT else depth[p] + 1)
        if best < 0 or depth[i] > depth[best]:
            best = i
    path: list[int] = []
    while best >= 0:
        path.append(tokens[best])
        best = parents[best]
    return path[::-1]


def first_children(tokens: list[int], parents: list[int], k: int) -> list[int]:
    """The first k level-one nodes' tokens."""
    return [t for t, p in zip(tokens, parents) if p == ROOT][:k]


def draft_candidates(proposer: Proposer, rows: list[Row], per_seq: int,
                     propose_kw: dict) -> tuple[torch.Tensor, TreeBatch]:
    """(keys [B * K, D + 1] int32 padded with -1, trees [B * K, N]) for rows, K = per_seq;
    the proposer is left at each row's committed tokens."""
    n = len(rows)
    sampling = [r.sampling for r in rows]
    picked = None if all(s is None for s in sampling) else sampling
    paths = [likely_path(r.tree_tokens, r.tree_parents) for r in rows]
    width = max(len(p) for p in paths) + 1
    try:
        for r, path in zip(rows, paths):
            proposer.update(r.seq_id, r.tokens + path, len(path), [], None)
        probe = proposer.propose([r.seq_id for r in rows], picked, **propose_kw)
        guesses = [first_children(t, p, per_seq)
                   for t, p in zip(probe.tokens.tolist(), probe.parents.tolist())]
        num_nodes = probe.tokens.shape[1]
        keys = torch.full((n * per_seq, width), -1, dtype=torch.int32)
        trees = TreeBatch.padding(n * per_seq, num_nodes)
        for k in range(per_seq):
            sel = [b for b in range(n) if len(guesses[b]) > k]
            if not sel:
                break
            for b in sel:
                r = rows[b]
                proposer.update(r.seq_id, r.tokens + paths[b] + [guesses[b][k]], 1, [], None)
            got = proposer.propose([rows[b].seq_id for b in sel],
                                   None if picked is None else [sampling[b] for b in sel],
                                   **propose_kw)
            at = [b * per_seq + k for b in sel]
            trees.tokens[at] = got.tokens.to(trees.tokens.dtype)
            trees.parents[at] = got.parents.to(trees.parents.dtype)
            for b in sel:
                key = paths[b] + [guesses[b][k]]
                keys[b * per_seq + k, :len(key)] = torch.tensor(key, dtype=torch.int32)
    finally:
        for r in rows:
            proposer.update(r.seq_id, r.tokens, 0, [], None)
    return keys, trees
