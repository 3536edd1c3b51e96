"""Lookahead: a sequence's next trees, drafted while the verify service verifies this one.

After answering a step, the draft guesses how the step will end for each sequence and
drafts the next step's tree for each guess, so that when the verify service finds its
outcome among the guesses, the next step needs no drafting on its critical path (the
verify picks the candidate itself and says which it took: ``SeqUpdate.lookahead_hit``).
A miss costs what a step costs without lookahead.

An outcome is what a step commits: the tree's accepted path, then the target's bonus
token. Per sequence of a tree of depth D, K candidates come from one draft step:

* the path guessed: the first deepest root-to-leaf path in node order (drafters emit
  nodes best first, so this is the drafter's most likely full acceptance);
* a *probe* tree drafted as if that path were committed: its level-one nodes are the
  drafter's best guesses of the bonus (with coupled sampling it draws them with the
  target's seeded noise); candidate k is keyed by path + guess k;
* candidate k's tree: where the drafter can draft one level deeper than the step's trees
  (the controller's budget under the envelope), the probe goes one level deeper and the
  subtree under guess k, re-rooted there, is the candidate: one batched draft step, as a
  step without lookahead drafts. Else each candidate is drafted after path + guess k (one
  more batched step per guess rank). Either way a candidate is as deep as the step's
  trees: subtrees one level shallower lost more tokens a step than their hits saved
  (bench/NOTES.md).

All of it runs while the target verifies; where it arrives after the verify is done, the
verify service stops asking (verify_service/draft_sync.py: AheadPrice). The proposer's state is then set back to the committed tokens (``update``
with no new tokens: drafters roll their KV back to the committed length, pages stay
reserved for the sequence), so a hit or a miss starts from the same state as a step
without lookahead.
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


def subtrees(tokens: list[int], parents: list[int], k: int, num_nodes: int
             ) -> list[tuple[int, list[int], list[int]]]:
    """For each of the first k level-one nodes: (its token, its subtree re-rooted at it:
    tokens and parents padded to num_nodes, in node order)."""
    out = []
    for top in [i for i, p in enumerate(parents) if p == ROOT][:k]:
        index = {top: ROOT}
        toks: list[int] = []
        pars: list[int] = []
        for i in range(top + 1, len(parents)):
            if parents[i] in index:          # a parent precedes its children
                index[i] = len(toks)
                toks.append(tokens[i])
                pars.append(index[parents[i]])
        pad = num_nodes - len(toks)
        out.append((tokens[top], toks + [0] * pad, pars + [PAD] * pad))
    return out


def draft_candidates(proposer: Proposer, rows: list[Row], per_seq: int,
                     probe_kw: dict | None) -> tuple[torch.Tensor, TreeBatch]:
    """(keys [B * K, D + 1] int32 padded with -1, trees [B * K, N]) for rows, K = per_seq;
    the proposer is left at each row's committed tokens. probe_kw: propose()'s arguments
    for a probe one level deeper than the step's trees, whose subtrees are the candidates;
    None: the probe is as deep as the step's trees and the candidates are drafted after
    it, one batched step per guess rank."""
    n = len(rows)
    sampling = [r.sampling for r in rows]
    picked = None if all(s is None for s in sampling) else sampling
    paths = [likely_path(r.tree_tokens, r.tree_parents) for r in rows]
    keys = torch.full((n * per_seq, max(len(p) for p in paths) + 1), -1, dtype=torch.int32)
    try:
        _extend(proposer, [(r.seq_id, r.tokens + path, len(path)) for r, path in zip(rows, paths)])
        probe = proposer.propose([r.seq_id for r in rows], picked, **(probe_kw or {}))
        num_nodes = probe.tokens.shape[1]
        trees = TreeBatch.padding(n * per_seq, num_nodes)
        guesses: list[list[int]] = []
        for b, (tt, pp) in enumerate(zip(probe.tokens.tolist(), probe.parents.tolist())):
            subs = subtrees(tt, pp, per_seq, num_nodes)
            guesses.append([g for g, _, _ in subs])
            for k, (guess, sub_t, sub_p) in enumerate(subs):
                key = paths[b] + [guess]
                keys[b * per_seq + k, :len(key)] = torch.tensor(key, dtype=torch.int32)
                if probe_kw is not None:
                    trees.tokens[b * per_seq + k] = torch.tensor(sub_t, dtype=torch.int32)
                    trees.parents[b * per_seq + k] = torch.tensor(sub_p, dtype=torch.int32)
        for k in range(per_seq if probe_kw is None else 0):
            sel = [b for b in range(n) if len(guesses[b]) > k]
            if not sel:
                break
            _extend(proposer, [(rows[b].seq_id, rows[b].tokens + paths[b] + [guesses[b][k]], 1)
                               for b in sel])
            got = proposer.propose([rows[b].seq_id for b in sel],
                                   None if picked is None else [sampling[b] for b in sel])
            at = [b * per_seq + k for b in sel]
            trees.tokens[at] = got.tokens.to(torch.int32)
            trees.parents[at] = got.parents.to(torch.int32)
    finally:
        for r in rows:
            proposer.update(r.seq_id, r.tokens, 0, [], None)
    return keys, trees


def _extend(proposer: Proposer, items: list[tuple[int, list[int], int]]) -> None:
    """Each (seq_id, tokens, count): the sequence goes on with count guessed tokens."""
    guess = getattr(proposer, "guess", None)
    if guess is not None:
        guess(items)
        return
    for seq_id, tokens, count in items:
        proposer.update(seq_id, tokens, count, [], None)
