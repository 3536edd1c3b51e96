"""What a draft has heard of each sequence, over one draft connection.

The verify service is the only authority on committed tokens; the draft keeps a
cache of them. For each sequence it has told the draft about, ``DraftSync`` keeps
how many committed tokens the draft holds and the step whose tree the sequence got
last, so an update carries only the new tokens and names the accepted path against
that tree. A new connection (``reset``) and the draft's own ``resync`` start a
sequence over with a ``full`` update. Also here: the step ids and the sequences
released since the last request.

Example: step 5 sends seq 3 in full, [1, 2, 3]; the target accepts node 0 of its
tree and adds a bonus, committing [1, 2, 3, 8, 9]; step 6 sends seq 3 new_tokens
[8, 9], committed_len 5, accepted_nodes [0] of step 5.

Target hidden states, for a drafter that reads them (EAGLE-3), travel once per
committed token: an update's row i is the state at the token *before*
new_tokens[i] (the state that predicted it; a full update's row 0 has none and is
zeros), taken from the sequence's captured states on the device; all rows of a step
leave the GPU together, one copy through a pinned buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.codec import Staging
from common.spec_types import SeqUpdate, SpecRequest

if TYPE_CHECKING:
    from verify_service.sequence import Sequence


@dataclass
class _Cursor:
    sent: int            # committed tokens the draft holds
    tree_step: int       # the step whose tree the sequence got last


class DraftSync:
    def __init__(self) -> None:
        self.epoch = 0                      # draft connections so far
        self.step_id = 0                    # the last request's step id
        self._cursors: dict[int, _Cursor] = {}
        self._released: list[int] = []
        self._staging = Staging()

    def reset(self) -> None:
        """A new draft connection: it knows no sequence."""
        self.epoch += 1
        self._cursors.clear()
        self._released = []

    def request(self, seqs: list[Sequence], hidden: bool, trace: dict[str, str]
                ) -> SpecRequest:
        """The next step's request for seqs; hidden: send target hidden states."""
        self.step_id += 1
        updates = []
        for s in seqs:
            c = self._cursors.get(s.seq_id)
            sent = c.sent if c is not None else 0
            updates.append(SeqUpdate(
                seq_id=s.seq_id, committed_len=len(s.tokens), new_tokens=s.tokens[sent:],
                full=sent == 0, accepted_nodes=s.accepted_path if c is not None else [],
                accepted_step_id=c.tree_step if c is not None else 0))
        if hidden:
            rows = to_host([update_rows(s, len(s.tokens) - len(u.new_tokens))
                            if s.hidden is not None else None
                            for s, u in zip(seqs, updates)], self._staging)
            for u, r in zip(updates, rows):
                u.hidden = r
        return SpecRequest(self.step_id, updates, self._released, trace_context=trace)

    def sent(self, seqs: list[Sequence]) -> None:
        """The last request left (the draft may have applied it, answer or not)."""
        self._released = []
        for s in seqs:
            self._cursors[s.seq_id] = _Cursor(len(s.tokens), self.step_id)

    def resync(self, seq_ids: list[int]) -> None:
        """The draft lost these: their next update is full."""
        for i in seq_ids:
            self._cursors.pop(i, None)

    def release(self, seq_ids: list[int]) -> None:
        """These ended; the draft hears it with the next request."""
        for i in seq_ids:
            if self._cursors.pop(i, None) is not None:
                self._released.append(i)


def update_rows(seq: Sequence, sent: int) -> torch.Tensor:
    """[len(seq.tokens) - sent, C] device rows for an update that brings a draft
    holding ``sent`` of the sequence's tokens up to all of them."""
    n = len(seq.tokens)
    hidden = seq.hidden.rows
    if sent == 0:
        return torch.cat([torch.zeros_like(hidden[:1]), hidden[:n - 1]])
    return hidden[sent - 1:n - 1]


def to_host(parts: list[torch.Tensor | None], staging: Staging) -> list[torch.Tensor | None]:
    """The same tensors on the host through one device-to-host copy (valid until
    staging's next copy)."""
    live = [p for p in parts if p is not None]
    if not live:
        return parts
    host = staging.host_copy(torch.cat(live))
    out: list[torch.Tensor | None] = []
    at = 0
    for p in parts:
        out.append(None if p is None else host[at:at + p.shape[0]])
        at += 0 if p is None else p.shape[0]
    return out
