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

Prefix caching (on unless ``--no-prefix-caching``). Pair t's feature ``f_t`` depends on
tokens ``s_0 .. s_t`` only, so page p of a sequence's units holds features named by the
same key as the verify service's page p of tokens (common/runtime/prefix_cache.py): full
pages below ``kv_len`` are registered with their KV *and* their feature rows (kept in a
store beside the pages, one row per slot). When the verify reuses its cached KV of a
prompt's first ``cached_len`` tokens it has no hidden states of them; its full update
says so and ``take_prefix`` starts the sequence from the cached pages of those tokens
(their KV, and their rows back into the sequence's RowBuffer), so only the rest crosses
and is forwarded. A unit's KV (EAGLE-3: the embedding of ``s_{t+1}``) may read the token
after its page, which the key does not name: the last unit of a reused prefix is
recomputed (its page copied first). Example, block size 4: a prompt of 10 tokens whose
first 8 the verify found cached comes as ``full``, cached_len 8, with the rows of tokens
9 (f_8); units 0 .. 7 come from pages keyed by tokens 0-3 and 0-7, unit 7 is redone with
unit 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespec.common.runtime.kv_cache import PagedKVCache
from treespec.common.runtime.row_buffer import RowBuffer
from treespec.common.serving.errors import InvalidRequest
from treespec.common.spec.tree import TreeEnvelope
from treespec.draft_service.draft_graphs import Extra
from treespec.draft_service.kv_drafter import DraftSeq, KVDrafter


@dataclass
class FeatureSeq(DraftSeq):
    feats: RowBuffer | None = None          # [pairs, C]: feats.rows[t] = f_t of pair t
    guessed: bool = False                   # its last pairs are a lookahead's guesses


class FeatureDrafter(KVDrafter):
    """A KVDrafter over committed pairs; the subclass sets ``head`` (its network, with
    device and dtype, and its projection ``fc``) and ``target_hidden_layers`` before
    KVDrafter.__init__."""

    head: torch.nn.Module
    target_hidden_layers: tuple[int, ...]

    def __init__(self, cache: PagedKVCache, env: TreeEnvelope, ops, model_name: str,
                 extras: list[Extra]) -> None:
        super().__init__(cache, env, ops, model_name, extras)
        # the registered pages' feature rows, slot for slot (prefix caching only)
        self._page_feats = None if cache.prefix is None else torch.zeros(
            cache.blocks.num_blocks, cache.block_size, self.feature_size,
            dtype=self.projection.dtype, device=self.projection.device)

    @property
    def projection(self) -> torch.Tensor:
        """[width, layers * hidden]: the head's fc."""
        return self.head.fc.weight

    @property
    def prefix_block_size(self) -> int:
        """DrafterInfo.prefix_block_size: its pages' tokens (0: no prefix caching)."""
        return 0 if self._page_feats is None else self.cache.block_size

    @property
    def feature_size(self) -> int:
        """A kept (projected) row's width."""
        return self.projection.shape[0]

    def _new(self) -> FeatureSeq:
        return FeatureSeq()

    def update(self, seq_id: int, tokens: list[int], new_count: int,
               accepted_nodes: list[int], hidden: torch.Tensor | None) -> None:
        rows = self._projected(seq_id, hidden, new_count)
        st = self.state(seq_id)
        if new_count == len(tokens):          # from nothing: s_0 has no pair
            self.cache.release(st.pages)
            st.feats = RowBuffer(rows[1:])
        else:       # (fewer tokens than it holds: a lookahead's guessed pairs taken back)
            old = len(tokens) - new_count - 1
            self.cache.rewind(st.pages, old)
            st.feats.truncate(old)
            st.feats.append(rows)
        st.tokens, st.guessed = tokens, False

    def take_prefix(self, seq_id: int, tokens: list[int], cached_len: int,
                    hidden: torch.Tensor | None) -> bool:
        """Start seq_id (new) from the cached pages of tokens[:cached_len] (their KV and
        feature rows) and hidden, the rows of tokens[cached_len + 1:]; False (nothing
        kept) when those pages are not all cached here."""
        bs = self.cache.block_size
        if self._page_feats is None or cached_len % bs:
            return False
        rows = self._projected(seq_id, hidden, len(tokens) - cached_len - 1)
        self.release(seq_id)
        st = self.state(seq_id)
        hit = self.cache.cached_prefix(st.pages, tokens[:cached_len + 1])
        if len(hit) < cached_len // bs:
            self.release(seq_id)
            return False
        st.feats = RowBuffer(torch.cat([self._page_feats[hit].flatten(0, 1), rows]))
        st.tokens = tokens
        self._take(st, hit, len(tokens) - 1)
        return True

    def _projected(self, seq_id: int, hidden: torch.Tensor | None, count: int
                   ) -> torch.Tensor:
        """hidden ([count, C] or [count, width] projected; None: zeros) projected, on
        the head's device, the caller's to keep."""
        proj = self.projection
        h, c = proj.shape
        if hidden is None:
            hidden = torch.zeros(count, h)
        elif hidden.dim() != 2 or hidden.shape[0] != count or hidden.shape[1] not in (h, c):
            raise InvalidRequest(
                f"seq {seq_id}: hidden states of shape {tuple(hidden.shape)}, the {self.name} "
                f"drafter needs [{count}, {c}] (layers {list(self.target_hidden_layers)} "
                f"of the target it was trained for) or [{count}, {h}] projected")
        # a host tensor may be the carrier's reused buffer: copied
        rows = hidden.to(proj.device, proj.dtype, copy=hidden.device.type == "cpu")
        if rows.shape[1] != h or h == c:
            rows = torch.nn.functional.linear(rows, proj)
        return rows

    # ------------------------------------------------------------ prefix caching
    def prefix_tokens(self, st: FeatureSeq) -> list[int] | None:
        return st.tokens

    def _reuse_prefix(self, st: FeatureSeq, units: int) -> None:
        """A sequence holding no pages (its KV dropped, or new) takes its longest cached
        prefix's; its feature rows it has."""
        if st.pages.pages or self.cache.prefix is None:
            return
        self._take(st, self.cache.cached_prefix(st.pages, st.tokens[:units]), units)

    def _take(self, st: FeatureSeq, hit: list[int], queried: int) -> None:
        self.cache.take_prefix(st.pages, hit, queried)
        if st.pages.kv_len:         # its last unit's KV may have read another next token
            self.cache.rewind(st.pages, st.pages.kv_len - 1)

    def _register(self, seqs: list[FeatureSeq]) -> None:
        """Full pages below kv_len join the cache with their feature rows (not while
        guessed pairs, whose rows are not the target's, sit below kv_len)."""
        if self._page_feats is None:
            return
        bs = self.cache.block_size
        for st in seqs:
            if st.guessed:
                continue
            before = st.pages.registered
            self.cache.register(st.pages, st.tokens)
            if st.pages.registered > before:
                pages = st.pages.pages[before:st.pages.registered]
                self._page_feats[pages] = st.feats.rows[before * bs:st.pages.registered * bs] \
                    .view(len(pages), bs, -1)

    def _units(self, st: FeatureSeq) -> int:
        return len(st.tokens) - 1

    def _inputs(self, st: FeatureSeq, lo: int, hi: int) -> tuple[list[int], list[torch.Tensor]]:
        return st.tokens[lo + 1:hi + 1], [st.feats.span(lo, hi)]
