"""The drafters whose units are committed (token, target feature) pairs: EAGLE-3, DFlash.

Alignment. With committed tokens ``s_0 .. s_n`` and target features ``f_t`` (the
named target layers' states at token ``s_t``, i.e. the state that predicted
``s_{t+1}``), unit ``t`` is the *committed pair* ``(s_{t+1}, f_t)`` at position t,
t = 0 .. n-1; the last pair's token is the root ``s_n``. The verify service sends,
with each new token ``s_j``, the row ``f_{j-1}`` (a full update's row 0 belongs to
``s_0``, which has no pair), so every committed token completes its pair on arrival.

Every pair's feature row stays on the device (a RowBuffer), so a sequence whose KV
was dropped for pages recomputes it like the draft model does. A missing hidden
tensor counts as zero features (worse drafts, the same output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.errors import InvalidRequest
from common.row_buffer import RowBuffer
from draft_service.kv_drafter import DraftSeq, KVDrafter


@dataclass
class FeatureSeq(DraftSeq):
    feats: RowBuffer | None = None          # [pairs, C]: feats.rows[t] = f_t of pair t


class FeatureDrafter(KVDrafter):
    """A KVDrafter over committed pairs; the subclass sets ``head`` (its network, with
    device and dtype), ``feature_size`` and ``target_hidden_layers`` before
    KVDrafter.__init__."""

    head: torch.nn.Module
    feature_size: int
    target_hidden_layers: tuple[int, ...]

    def _new(self) -> FeatureSeq:
        return FeatureSeq()

    def update(self, seq_id: int, tokens: list[int], new_count: int,
               accepted_nodes: list[int], hidden: torch.Tensor | None) -> None:
        c = self.feature_size
        if hidden is None:
            hidden = torch.zeros(new_count, c)
        elif hidden.dim() != 2 or hidden.shape != (new_count, c):
            raise InvalidRequest(
                f"seq {seq_id}: hidden states of shape {tuple(hidden.shape)}, the {self.name} "
                f"drafter needs [{new_count}, {c}] (layers {list(self.target_hidden_layers)} "
                "of the target it was trained for)")
        st = self.state(seq_id)
        # a host tensor may be the carrier's reused buffer: copied; stage()'s are our own
        rows = hidden.to(self.head.device, self.head.dtype, copy=hidden.device.type == "cpu")
        if new_count == len(tokens):          # from nothing: s_0 has no pair
            self.cache.release(st.pages)
            st.feats = RowBuffer(rows[1:])
        else:
            st.feats.append(rows)
        st.tokens = tokens

    def stage(self, hidden: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """A request's hidden states on the device in one copy where they lie together in
        pinned memory (the carrier's shared buffer, registered with CUDA), as views; the
        rest stay as they came, for update to copy a row at a time (or refuse). Measured
        on the H200 (bench/NOTES.md, seventeenth session): a gather into pageable memory
        and one copy cost more than a copy a row."""
        ok = [i for i, h in enumerate(hidden)
              if h is not None and h.dim() == 2 and h.shape[1] == self.feature_size]
        if len(ok) < 2 or self.head.device.type != "cuda" or not hidden[ok[0]].is_pinned():
            return hidden
        views = one_copy([hidden[i] for i in ok], self.head.device, self.head.dtype)
        if views is None:
            return hidden
        out = list(hidden)
        for i, v in zip(ok, views):
            out[i] = v
        return out

    def _units(self, st: FeatureSeq) -> int:
        return len(st.tokens) - 1

    def _inputs(self, st: FeatureSeq, lo: int, hi: int) -> tuple[list[int], list[torch.Tensor]]:
        return st.tokens[lo + 1:hi + 1], [st.feats.rows[lo:hi]]


def one_copy(rows: list[torch.Tensor], device: torch.device | str,
             dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Host rows that lie in one storage, on device in one copy of the span they cover
    (asynchronous from pinned memory, complete on return: the carrier reuses its buffer
    once answered), as views in their order; None where they do not lie together."""
    first = rows[0]
    storage = first.untyped_storage()
    if any(r.untyped_storage().data_ptr() != storage.data_ptr() or r.dtype != first.dtype
           or not r.is_contiguous() for r in rows):
        return None
    lo = min(r.storage_offset() for r in rows)
    hi = max(r.storage_offset() + r.numel() for r in rows)
    if hi - lo > 2 * sum(r.numel() for r in rows):
        return None                    # scattered: the span would copy more than the rows
    span = first.new_empty(0).set_(storage, lo, (hi - lo,))
    on = span.to(device, non_blocking=True, copy=True).to(dtype)
    if on.is_cuda:
        torch.cuda.current_stream(on.device).synchronize()
    return [on[r.storage_offset() - lo:r.storage_offset() - lo + r.numel()].view(r.shape)
            for r in rows]
