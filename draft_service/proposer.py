"""The one interface every draft method implements, and the padded tree it fills.

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
   ``[new_count, layers * hidden]`` target states, only for proposers that name
   ``target_hidden_layers``;
3. ``propose(seq_ids)`` once for the batch: ``tokens, parents [B, N] int32``
   host tensors, rows in ``seq_ids`` order, padded with ``parents = -2, tokens = 0``.
   They are the proposer's to give away: the engine answers with them as they are.

A proposer must tolerate anything the engine lets through (a state it dropped on
its own, accepted nodes that do not match): it recomputes rather than fails.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from common.tree import PAD


class Proposer(Protocol):
    name: str                                # reported as DrafterInfo.proposer
    vocab_size: int                          # 0 = copies tokens, fits any vocabulary
    target_hidden_layers: tuple[int, ...]    # target layers it needs hidden states of
    model: str                               # checkpoint it drafts with, "" if none
    light: bool                              # a step is host work far under 1 ms: the
                                             # servicer runs it on its event loop

    def update(self, seq_id: int, tokens: list[int], new_count: int,
               accepted_nodes: list[int], hidden: torch.Tensor | None) -> None: ...

    def propose(self, seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def release(self, seq_id: int) -> None: ...


def padding_trees(batch: int, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All-padding rows: tokens [B, N] = 0, parents [B, N] = -2 (int32, host)."""
    return (torch.zeros(batch, num_nodes, dtype=torch.int32),
            torch.full((batch, num_nodes), PAD, dtype=torch.int32))


def warm_up(p: Proposer, lengths: tuple[int, ...] = (8, 200, 1100), batch: int = 8) -> float:
    """Run what first requests run: first syncs of several lengths, a decode-sized
    step after each, and a batch, so that Triton compiles and CUDA graph captures
    (seconds on a GPU) happen before serving, not inside a step the verify service
    waits for under its deadline. Sequences get ids no engine hands out (< 0) and
    are released: no state or page is left behind. Returns the seconds taken."""
    t0 = time.perf_counter()
    groups = [[n] for n in lengths] + [[lengths[0]] * batch]
    for g, sizes in enumerate(groups):
        ids = [-1000 * (g + 1) - i for i in range(len(sizes))]
        for sid, n in zip(ids, sizes):
            p.update(sid, [1] * n, n, [], None)
        p.propose(ids)
        for sid, n in zip(ids, sizes):
            p.update(sid, [1] * (n + 1), 1, [], None)
        p.propose(ids)
        for sid in ids:
            p.release(sid)
    return time.perf_counter() - t0
