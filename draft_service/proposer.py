"""The one interface every draft method implements.

The engine owns each sequence's committed token list and tells a proposer what
changed; the proposer keeps whatever derived state it wants (an n-gram index, a
draft KV cache) and proposes one fixed-envelope tree per sequence.

Calling convention, per speculative step:

1. ``release(s)`` for each finished or resynced sequence (and before a ``full``
   reset, so the next ``update`` starts from nothing);
2. ``update(s, tokens, new_count, accepted_nodes, hidden)`` for each sequence of
   the batch: ``tokens`` is the whole committed list, of which the last
   ``new_count`` are new since the proposer last saw ``s`` (all of them for a
   sequence it does not know). ``accepted_nodes`` index the tree this proposer
   emitted for ``s`` last step (root to leaf, possibly empty); the engine passes
   them only when they refer to that tree. ``hidden`` is
   ``[new_count, layers * hidden]`` target states (or ``[new_count, width]``
   already through the proposer's ``projection``), only for proposers that name
   ``target_hidden_layers``, borrowed (it may be a view of the connection's shared
   buffer, rewritten after the step: copy what is kept);
3. ``propose(seq_ids, sampling)`` once for the batch: a ``TreeBatch`` with rows in
   ``seq_ids`` order (host tensors, the proposer's to give away). ``sampling`` is
   None when every row is greedy, else each row's RowSampling (None for a greedy
   row): a drafter that can picks the children of a sampling row's nodes as
   treespec.common.spec.sampling.draft_scores does; one that cannot (n-gram) ignores it.

A proposer must tolerate anything the engine lets through (a state it dropped on
its own, accepted nodes that do not match): it recomputes rather than fails. A
new method is one module with a class like this and one line in
draft_service/registry.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from treespec.common.spec.sampling import SamplingParams
from treespec.common.spec.tree import TreeBatch

if TYPE_CHECKING:
    from treespec.draft_service.config import DraftConfig


@dataclass(frozen=True)
class RowSampling:
    """How a sampling request's row drafts: its resolved parameters, and whether the
    verify accepts its nodes by rejection sampling (then the tree's shape must not
    depend on what is drawn, and each node's q goes back) or coupled."""
    params: SamplingParams
    rejection: bool = False


class Proposer(Protocol):
    name: str                                # reported as DrafterInfo.proposer
    vocab_size: int                          # 0 = copies tokens, fits any vocabulary
    target_hidden_layers: tuple[int, ...]    # target layers it needs hidden states of
    model: str                               # checkpoint it drafts with, "" if none
    light: bool                              # a step is host work far under 1 ms: the
                                             # servicer runs it on its event loop
    # optional: levels = True when propose takes depth= (the verify takes nothing deeper;
    # such a drafter expands fewer levels, at fewer forwards); the others are pruned.
    # optional: lookahead = True when update() may be handed tokens that a later update
    # takes back (fewer committed tokens than it last saw: drop what came after them);
    # only such a drafter pre-drafts candidates (draft_service/lookahead.py); one that
    # also has draft_candidates(rows, k) -> (keys, trees) drafts them itself (the replay
    # instrument, whose outcomes are known); one with guess(items) extends sequences by
    # guessed tokens through it, not update (EAGLE-3: its own outputs as their features)
    # optional: projection, a [width, layers * hidden] tensor: the proposer's first use
    # of hidden states is x @ projection.T, and it takes them either way
    # optional: take_prefix(seq_id, tokens, cached_len, hidden) -> bool, for a full
    # update whose first cached_len tokens' hidden states the verify does not have (it
    # reused their cached KV): start from the proposer's own cached state of them, hidden
    # holding the rows of tokens[cached_len + 1:]; False when it has none (the engine then
    # reports the sequence lost_prefix)

    @classmethod
    def from_config(cls, cfg: DraftConfig) -> Proposer: ...

    def update(self, seq_id: int, tokens: list[int], new_count: int,
               accepted_nodes: list[int], hidden: torch.Tensor | None) -> None: ...

    def propose(self, seq_ids: list[int],
                sampling: list[RowSampling | None] | None = None) -> TreeBatch: ...

    def release(self, seq_id: int) -> None: ...
