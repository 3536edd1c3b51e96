"""Where a step's captured target hidden states go: each sequence's RowBuffer, which
a drafter of hidden states (EAGLE-3, DFlash) reads when the sequence is asked for a tree.

A step appends each sequence's path rows ([1 + accepted, C]). A step that accepted
nothing anywhere (the controller running the batch plain, most of all) appends one row
a sequence; while the batch stays the same, those rows go into a [batch, STAGE, C]
tensor, one copy a step, and land in the sequences' buffers only when a drafter is to
read them, the stage is full or the batch changes. A plain step pays one copy, not a
clone and a view and an append per sequence (64 a step at b64).
"""

from __future__ import annotations

import torch

from verify_service.sequence import Sequence

STAGE = 32


class HiddenRows:
    def __init__(self) -> None:
        self._seqs: list[Sequence] = []
        self._ids: list[int] = []
        self._stage: torch.Tensor | None = None
        self._n = 0

    def add(self, seqs: list[Sequence], path: torch.Tensor | None,
            accepted: list[list[int]]) -> None:
        """path: the step's [len(seqs), 1 + longest accepted, C] rows, read here before
        the next step overwrites them (a graph's output); None: nothing captured, so no
        sequence keeps rows. accepted: each sequence's accepted nodes."""
        if path is None:
            self.flush()
            for s in seqs:
                s.hidden = None
            return
        if path.shape[1] == 1:
            ids = [s.seq_id for s in seqs]
            if self._n == STAGE or ids != self._ids:
                self.flush()
            if self._stage is None:
                self._seqs, self._ids = list(seqs), ids
                self._stage = path.new_empty((len(seqs), STAGE, path.shape[2]))
            self._stage[:, self._n].copy_(path[:, 0])
            self._n += 1
            return
        self.flush()
        m = path.shape[1] - 1
        for s, r, a in zip(seqs, path.clone().unbind(0), accepted):
            if s.hidden is not None:
                s.hidden.append(r if len(a) == m else r[:1 + len(a)])

    def flush(self) -> None:
        """Hand the staged rows to their sequences (before a drafter reads any)."""
        if self._stage is not None:
            for s, r in zip(self._seqs, self._stage[:, :self._n].unbind(0)):
                if s.hidden is not None:        # landed now: nothing keeps the stage
                    s.hidden.append(r)
                    s.hidden.land()
        self._seqs, self._ids, self._stage, self._n = [], [], None, 0
