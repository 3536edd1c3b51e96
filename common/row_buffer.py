"""A device tensor of rows that grows at its end: appending costs O(rows) amortized.

Both services keep one per sequence of target hidden states ([tokens, C]) while a
drafter reads them: the verify service what it captured, the EAGLE-3 drafter what
it was sent.
"""

from __future__ import annotations

import torch


class RowBuffer:
    def __init__(self, rows: torch.Tensor) -> None:
        self._buf = rows            # borrowed (e.g. a view of a prefill's output) until grown
        self._owned = False
        self.len = rows.shape[0]

    def append(self, rows: torch.Tensor) -> None:
        need = self.len + rows.shape[0]
        if need > self._buf.shape[0] or not self._owned:
            grown = self._buf.new_empty((max(need, 2 * self._buf.shape[0]), *self._buf.shape[1:]))
            grown[:self.len] = self._buf[:self.len]
            self._buf, self._owned = grown, True
        self._buf[self.len:need] = rows
        self.len = need

    @property
    def rows(self) -> torch.Tensor:
        return self._buf[:self.len]
