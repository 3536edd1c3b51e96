"""A device tensor of rows that grows at its end: appending costs O(rows) amortized.

Both services keep one per sequence of target hidden states ([tokens, C]) while a
drafter reads them: the verify service what it captured, the EAGLE-3 drafter what
it was sent. Appended rows wait as views (no device work: a step appends to every
sequence, and while the controller runs plain nobody reads them) and land in one copy
when the rows are read or ``FLUSH_AT`` appends wait (what they keep alive stays bounded).
"""

from __future__ import annotations

import torch

FLUSH_AT = 32


class RowBuffer:
    def __init__(self, rows: torch.Tensor) -> None:
        self._buf = rows            # borrowed (e.g. a view of a prefill's output) until grown
        self._owned = False
        self._landed = self.len = rows.shape[0]
        self._waiting: list[torch.Tensor] = []

    def append(self, rows: torch.Tensor) -> None:
        """rows must not change until read (a clone of a graph's output, not the output)."""
        self._waiting.append(rows)
        self.len += rows.shape[0]
        if len(self._waiting) >= FLUSH_AT:
            self._land()

    @torch.inference_mode()       # a drafter reads inside its step's inference mode, but
    def _land(self) -> None:        # appends outside it: both must write the same kind
        if self.len > self._buf.shape[0] or not self._owned:
            grown = self._buf.new_empty((max(self.len, 2 * self._buf.shape[0]),
                                         *self._buf.shape[1:]))
            grown[:self._landed] = self._buf[:self._landed]
            self._buf, self._owned = grown, True
        torch.cat(self._waiting, out=self._buf[self._landed:self.len])
        self._landed, self._waiting = self.len, []

    def truncate(self, n: int) -> None:
        """Keep the first n rows (a drafter's guessed rows, taken back)."""
        if n < self.len:
            if self._waiting:
                self._land()
            self.len = self._landed = n

    def span(self, lo: int, hi: int) -> torch.Tensor:
        """rows[lo:hi]; the last append's rows as they are (no copy) when that is
        what is asked, as a drafter's step asks for the units its update brought."""
        if self._waiting and (lo, hi) == (self.len - self._waiting[-1].shape[0], self.len):
            return self._waiting[-1]
        return self.rows[lo:hi]

    @property
    def rows(self) -> torch.Tensor:
        if self._waiting:
            self._land()
        return self._buf[:self.len]
