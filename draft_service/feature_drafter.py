"""The drafters whose units are committed (token, target feature) pairs: EAGLE-3, DFlash.

Alignment. With committed tokens ``s_0 .. s_n`` and target features ``f_t`` (the
named target layers' states at token ``s_t``, i.e. the state that predicted
``s_{t+1}``), unit ``t`` is the *committed pair* ``(s_{t+1}, f_t)`` at position t,
t = 0 .. n-1; the last pair's token is the root ``s_n``. The verify service sends,
with each new token ``s_j``, the row ``f_{j-1}`` (a full update's row 0 belongs to
``s_0``, which has no pair), so every committed token completes its pair on arrival.

Every pair's feature row stays on the device (a RowBuffer), so a sequence whose KV
was dropped for pages recomputes it like the draft model does. Rows are kept
projected (the head's ``fc``, its first use of them): the verify service sends them
so where it has fetched the projection (DrafterInfo.projected_width), and rows that
arrive as the target's layers are projected here. A missing hidden tensor counts as
zero features (worse drafts, the same output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespec.common.serving.errors import InvalidRequest
from treespec.common.runtime.row_buffer import RowBuffer
from treespec.draft_service.kv_drafter import DraftSeq, KVDrafter


@dataclass
class FeatureSeq(DraftSeq):
    feats: RowBuffer | None = None          # [pairs, C]: feats.rows[t] = f_t of pair t


class FeatureDrafter(KVDrafter):
    """A KVDrafter over committed pairs; the subclass sets ``head`` (its network, with
    device and dtype, and its projection ``fc``) and ``target_hidden_layers`` before
    KVDrafter.__init__."""

    head: torch.nn.Module
    target_hidden_layers: tuple[int, ...]

    @property
    def projection(self) -> torch.Tensor:
        """[width, layers * hidden]: the head's fc."""
        return self.head.fc.weight

    @property
    def feature_size(self) -> int:
        """A kept (projected) row's width."""
        return self.projection.shape[0]

    def _new(self) -> FeatureSeq:
        return FeatureSeq()

    def update(self, seq_id: int, tokens: list[int], new_count: int,
               accepted_nodes: list[int], hidden: torch.Tensor | None) -> None:
        proj = self.projection
        h, c = proj.shape
        if hidden is None:
            hidden = torch.zeros(new_count, h)
        elif hidden.dim() != 2 or hidden.shape[0] != new_count or hidden.shape[1] not in (h, c):
            raise InvalidRequest(
                f"seq {seq_id}: hidden states of shape {tuple(hidden.shape)}, the {self.name} "
                f"drafter needs [{new_count}, {c}] (layers {list(self.target_hidden_layers)} "
                f"of the target it was trained for) or [{new_count}, {h}] projected")
        st = self.state(seq_id)
        # a host tensor may be the carrier's reused buffer: copied
        rows = hidden.to(proj.device, proj.dtype, copy=hidden.device.type == "cpu")
        if rows.shape[1] != h or h == c:
            rows = torch.nn.functional.linear(rows, proj)
        if new_count == len(tokens):          # from nothing: s_0 has no pair
            self.cache.release(st.pages)
            st.feats = RowBuffer(rows[1:])
        else:
            st.feats.append(rows)
        st.tokens = tokens

    def _units(self, st: FeatureSeq) -> int:
        return len(st.tokens) - 1

    def _inputs(self, st: FeatureSeq, lo: int, hi: int) -> tuple[list[int], list[torch.Tensor]]:
        return st.tokens[lo + 1:hi + 1], [st.feats.span(lo, hi)]
