"""Which target hidden states travel to a drafter that reads them (EAGLE-3).

A sequence keeps its captured states ([kv_len, C], common.row_buffer.RowBuffer) on
the device while such a drafter is connected.

Only committed tokens' states travel, once. For an update carrying new_tokens,
row i is the target state at the token *before* new_tokens[i] (the state that
predicted it); a full update's row 0 has no predecessor and is zeros. All rows of
a step leave the GPU together: one device-to-host copy through a pinned buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.codec import Staging

if TYPE_CHECKING:
    from verify_service.sequence import Sequence


def update_rows(seq: Sequence, sent: int) -> torch.Tensor:
    """[len(seq.tokens) - sent, C] device rows for an update that brings a draft
    holding ``sent`` of the sequence's tokens up to all of them (``sent`` 0: a full
    update, whose row 0 is zeros)."""
    n = len(seq.tokens)
    hidden = seq.hidden.rows
    if sent == 0:
        return torch.cat([torch.zeros_like(hidden[:1]), hidden[:n - 1]])
    return hidden[sent - 1:n - 1]


def to_host(parts: list[torch.Tensor | None], staging: Staging) -> list[torch.Tensor | None]:
    """The same tensors on the host, all through one device-to-host copy (valid until
    staging's next copy)."""
    live = [p for p in parts if p is not None]
    if not live:
        return parts
    host = staging.host_copy(torch.cat(live))
    out: list[torch.Tensor | None] = []
    at = 0
    for p in parts:
        if p is None:
            out.append(None)
            continue
        out.append(host[at:at + p.shape[0]])
        at += p.shape[0]
    return out
