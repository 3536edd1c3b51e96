"""Which target hidden states travel to a drafter that reads them (EAGLE-3).

Only committed tokens' states travel, once. For an update carrying new_tokens,
row i is the target state at the token *before* new_tokens[i] (the state that
predicted it); a full update's row 0 has no predecessor and is zeros. All rows of
a step leave the GPU together: one device-to-host copy through a pinned buffer.
"""

from __future__ import annotations

import torch

from common.codec import Staging
from verify_service.sequence import Sequence


class HiddenBuffer:
    """A sequence's captured target states [len, C] on the device, grown by
    doubling: appending a step's rows costs O(rows) amortized, not a copy of the
    whole history (the sequence's states are kept while a drafter reads them)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self._buf = rows            # borrowed (a view of the prefill's output) until grown
        self._owned = False
        self.len = rows.shape[0]

    def append(self, rows: torch.Tensor) -> None:
        need = self.len + rows.shape[0]
        if need > self._buf.shape[0] or not self._owned:
            grown = self._buf.new_empty((max(need, 2 * self._buf.shape[0]), self._buf.shape[1]))
            grown[:self.len] = self._buf[:self.len]
            self._buf, self._owned = grown, True
        self._buf[self.len:need] = rows
        self.len = need

    @property
    def rows(self) -> torch.Tensor:
        return self._buf[:self.len]


def rows_of(seq: Sequence) -> torch.Tensor:
    """[len(update's new_tokens), C] device rows for this sequence's next update."""
    n = len(seq.tokens)
    hidden = seq.hidden.rows
    if not seq.draft_synced:
        zero = torch.zeros_like(hidden[:1])
        return torch.cat([zero, hidden[:n - 1]])
    start = n - len(seq.unsent) - 1
    return hidden[start:n - 1]


def hidden_rows_for(seqs: list[Sequence], staging: Staging) -> list[torch.Tensor | None]:
    """Host tensors, one per sequence (None where nothing was captured)."""
    parts = [rows_of(s) if s.hidden is not None else None for s in seqs]
    live = [p for p in parts if p is not None]
    if not live:
        return parts
    host = staging.host_copy(torch.cat(live))     # valid until the next host_copy
    out: list[torch.Tensor | None] = []
    at = 0
    for p in parts:
        if p is None:
            out.append(None)
            continue
        out.append(host[at:at + p.shape[0]])
        at += p.shape[0]
    return out
