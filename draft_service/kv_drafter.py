"""The base of the drafters that run a network over their own paged KV cache (draft
model, EAGLE-3, DFlash). A drafter of this
kind forwards *units* of a sequence (the draft model: committed tokens; EAGLE-3 and
DFlash: committed (token, target feature) pairs) into its KV cache and drafts from
the newest one. Per sequence it keeps a SeqPages whose ``kv_len``
units have draft KV. One step over the batch:

1. *reserve* pages for each row's units plus the tree's scratch; when pages run
   out, idle sequences' KV is dropped (least recently used first; it is
   recomputed when they next draft); a row that still does not fit drafts nothing;
2. *catch up*: a row's units without KV (at least the newest, whose output seeds
   the tree) beyond the step's catch-up length ``depth + 1`` (a new prompt, a
   resync) are forwarded eagerly first (``_prefill``), writing their KV, in
   forwards of at most PREFILL_UNITS units (memory linear in the sequence);
3. *draft*: ONE replay of the subclass's fixed-shape step (``_step_fn``): the last
   1 .. depth + 1 units of each row as a padded chain, then the tree expansion and
   rerank, all on the device. In steady state a row brings the accepted path and
   the bonus token, at most depth + 1 units, so a step is one replay. When the
   verify will take a shallower tree (the request's max_depth), a ``levels``
   drafter replays a graph made for that depth (the draft model and EAGLE-3 expand
   only that many levels; DFlash takes the LM head on that many block positions).

Prefix caching, for a drafter whose units' KV its tokens decide (``prefix_tokens``): a
sequence holding no pages starts from the cached pages of its tokens' longest cached
prefix (at least the newest unit left to forward), and its pages join the cache once
full below ``kv_len`` (common/runtime/prefix_cache.py). A unit's KV is then shared, so
going back over it (``rewind``) copies its page first. EAGLE-3 and DFlash units also
carry the target's features, which depend on the tokens too: they cache them with the
pages (draft_service/feature_drafter.py).

A batch with a sampling row drafts it with the request's seeded noise
(treespec.common.spec.sampling.draft_scores through tree_build.Expansion). The graphs:
treespec.draft_service.draft_graphs.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from types import ModuleType

import torch

from treespec.common.runtime.block_manager import OutOfPages
from treespec.common.runtime.devices import bind_device, pick_device, pick_dtype
from treespec.common.runtime.graph_buckets import BATCH_BUCKETS
from treespec.common.runtime.kv_cache import PagedKVCache, SeqPages
from treespec.common.spec.sampling import SamplingParams
from treespec.common.spec.tree import PAD, TreeBatch, TreeEnvelope, budget_depths
from treespec.draft_service.draft_graphs import DraftGraphs, Extra
from treespec.draft_service.lookahead import Row, draft_candidates
from treespec.draft_service.proposer import RowSampling

log = logging.getLogger("treespec.draft")

# warm-up captures every batch bucket up to this one
WARM_BATCH = 64
# units one eager catch-up forward takes at most: a new or resynced sequence goes
# through the network this many units at a time, so a forward's activations stay
# [chunk, ...] and its attention [chunk, context] (the CPU reference also takes those
# queries in tiles: kernels/reference_attention.py TILE_SCORES)
PREFILL_UNITS = 4096


@dataclass
class DraftSeq:
    pages: SeqPages = field(default_factory=SeqPages)
    tokens: list[int] = field(default_factory=list)     # the engine's committed list


def prefill_parts(rows: list[tuple[DraftSeq, int, int]], limit: int
                  ) -> list[list[tuple[DraftSeq, int, int]]]:
    """rows' spans (st, lo, hi) cut into forwards of at most limit units, in order: a
    long span continues in the next part (a row is at most once in a part)."""
    parts: list[list[tuple[DraftSeq, int, int]]] = [[]]
    room = limit
    for st, lo, hi in rows:
        while lo < hi:
            take = min(hi - lo, room)
            parts[-1].append((st, lo, lo + take))
            lo, room = lo + take, room - take
            if room == 0:
                parts.append([])
                room = limit
    return [p for p in parts if p]


class KVDrafter:
    """What a subclass provides: ``_new`` (its DraftSeq), ``_units``, ``_inputs``,
    ``_prefill``, ``_step_fn`` (returns tokens, parents [B, N] and anything else it
    wants back in ``_drafted``), and ``update`` (the Proposer protocol's)."""

    light = False
    levels = False          # a shallower tree costs less: fewer forwards, or LM-head rows

    def __init__(self, cache: PagedKVCache, env: TreeEnvelope, ops: ModuleType,
                 model_name: str, extras: list[Extra]) -> None:
        self.cache, self.env, self.ops, self.model = cache, env, ops, model_name
        self._seqs: OrderedDict[int, DraftSeq] = OrderedDict()
        self.graphs = DraftGraphs(cache, env.depth + 1, self._step_fn, extras)
        # slots a step writes past a row's units: the tree's scratch, and the padded
        # tail of a fixed-shape catch-up (up to depth slots after a one-unit catch-up)
        self._scratch = max((env.depth - 1) * env.topk, env.depth)
        self._short = 0                     # rows that found no pages so far

    @classmethod
    def from_config(cls, cfg) -> KVDrafter:
        """Loaded on cfg's device (made current: graphs and pinned staging land on it)
        and, on a GPU, warmed up."""
        device = pick_device(cfg.device)
        bind_device(device)
        p = cls.load(cfg, device, pick_dtype(cfg.dtype, device))
        if device.type == "cuda":
            log.info("%s warm-up (kernel compiles, graph captures) took %.1f s", cls.name,
                     p.warm_up(lookahead=bool(cfg.lookahead and getattr(p, "lookahead", False))))
        return p

    # ------------------------------------------------------------ subclass hooks
    @classmethod
    def load(cls, cfg, device: torch.device, dtype: torch.dtype) -> KVDrafter:
        raise NotImplementedError

    def _new(self) -> DraftSeq:
        return DraftSeq()

    def _units(self, st: DraftSeq) -> int:
        raise NotImplementedError

    def _inputs(self, st: DraftSeq, lo: int, hi: int) -> tuple[list[int], list[torch.Tensor]]:
        """Units lo .. hi - 1: their tokens and each extra input's rows."""
        raise NotImplementedError

    def _prefill(self, rows: list[tuple[DraftSeq, int, int]]) -> None:
        """Write the KV of units lo .. hi - 1 of each (st, lo, hi), from st.pages.kv_len == lo."""
        raise NotImplementedError

    def _step_fn(self, tokens: torch.Tensor, count: torch.Tensor, ctx0: torch.Tensor,
                 table: torch.Tensor, *extras: torch.Tensor,
                 sampling: list[torch.Tensor] | None = None, depth: int = 0
                 ) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _before_step(self) -> None:
        """Device work owed before this step's forwards (the draft model's KV moves)."""

    def _drafted(self, seqs: list[DraftSeq], out: tuple[torch.Tensor, ...]) -> None:
        """Remember what was drafted (the draft model: for its rollback). out: the
        step's outputs (tokens, parents, the subclass's), on the host."""

    def _forget(self, st: DraftSeq) -> None:
        """st's KV was dropped: forget whatever refers to it."""

    def prefix_tokens(self, st: DraftSeq) -> list[int] | None:
        """The tokens that alone decide st's units' KV (None: they do not, no prefix
        caching): unit i's KV is then keyed by tokens[:i + 1]."""
        return None

    # ------------------------------------------------------------ the Proposer protocol
    def state(self, seq_id: int) -> DraftSeq:
        """seq_id's state, created if new, made the most recently used."""
        st = self._seqs.get(seq_id)
        if st is None:
            st = self._seqs[seq_id] = self._new()
        self._seqs.move_to_end(seq_id)
        return st

    def release(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is not None:
            self.cache.release(st.pages)

    def propose(self, seq_ids: list[int], sampling: list[RowSampling | None] | None = None,
                depth: int = 0) -> TreeBatch:
        """depth: the verify takes no deeper nodes (0: the envelope's); a ``levels``
        drafter then expands that many levels only (greedy batches)."""
        self._before_step()
        rows = self._reserve(seq_ids)
        if not rows:
            return TreeBatch.padding(len(seq_ids), self.env.num_nodes)
        picked = None if sampling is None else [sampling[r] for r in rows]
        if picked is not None and all(q is None for q in picked):
            picked = None
        shallow = depth if self.levels and picked is None and 0 < depth < self.env.depth else 0
        trees = self._draft([self._seqs[seq_ids[r]] for r in rows], picked, shallow)
        return trees.scatter(rows, len(seq_ids))

    def _reserve(self, seq_ids: list[int]) -> list[int]:
        """Rows that can draft: at least one unit, and pages for all units plus the
        scratch (dropping idle sequences' KV, least recently used first, if need be)."""
        batch = set(seq_ids)
        rows = []
        for r, s in enumerate(seq_ids):
            st = self._seqs[s]
            units = self._units(st)
            if units < 1:
                continue
            self._reuse_prefix(st, units)
            while True:
                try:
                    self.cache.reserve(st.pages, units + self._scratch)
                    rows.append(r)
                    break
                except OutOfPages:
                    idle = next((v for k, v in self._seqs.items()
                                 if k not in batch and v.pages.pages), None)
                    if idle is None:
                        self._out_of_pages(s)
                        break
                    self.cache.release(idle.pages)
                    self._forget(idle)
        return rows

    def _reuse_prefix(self, st: DraftSeq, units: int) -> None:
        """A sequence holding no pages takes those of its longest cached prefix."""
        if st.pages.pages or self.cache.prefix is None:
            return
        tokens = self.prefix_tokens(st)
        if tokens is not None:
            hit = self.cache.cached_prefix(st.pages, tokens[:units])
            self.cache.take_prefix(st.pages, hit, units)

    def _register(self, seqs: list[DraftSeq]) -> None:
        """Offer the sequences' full pages below kv_len to the prefix cache."""
        if self.cache.prefix is None:
            return
        for st in seqs:
            tokens = self.prefix_tokens(st)
            if tokens is not None:
                self.cache.register(st.pages, tokens)

    def _out_of_pages(self, seq_id: int) -> None:
        self._short += 1
        if self._short in (1, 100) or self._short % 10000 == 0:
            log.warning("draft KV pages ran out (%d pages of %d tokens): sequence %d drafts "
                        "nothing this step (%d such rows so far); --num-blocks raises the limit",
                        self.cache.blocks.num_blocks, self.cache.block_size, seq_id, self._short)

    @torch.inference_mode()
    def _draft(self, seqs: list[DraftSeq], sampling: list[RowSampling | None] | None,
               depth: int = 0) -> TreeBatch:
        c = self.graphs.catch_up_len
        units = [self._units(st) for st in seqs]
        for st, u in zip(seqs, units):
            self.cache.rewind(st.pages, u - 1)       # the newest unit is redone
        behind = [(st, st.pages.kv_len, u - c) for st, u in zip(seqs, units)
                  if u - st.pages.kv_len > c]
        for part in prefill_parts(behind, PREFILL_UNITS):
            self._prefill(part)
            for st, _, hi in part:
                st.pages.kv_len = hi
        inputs = [self._inputs(st, st.pages.kv_len, u) for st, u in zip(seqs, units)]
        out = self.graphs([t for t, _ in inputs], [x for _, x in inputs],
                          [st.pages for st in seqs], sampling, depth)
        if depth:           # a shallower tree, widened to the envelope's nodes
            fills = (0, PAD) + (-1,) * (len(out) - 2)
            out = tuple(torch.nn.functional.pad(x, (0, self.env.num_nodes - x.shape[1]),
                                                value=f) for x, f in zip(out, fills))
        for st, u in zip(seqs, units):
            st.pages.kv_len = u
        self._register(seqs)
        rejection = sampling is not None and any(r and r.rejection for r in sampling)
        self._drafted(seqs, out)
        trees = TreeBatch(out[0], out[1])
        if rejection:
            trees.q_ids, trees.q_probs = out[-2], out[-1]
        return trees

    def warm_up(self, lengths: tuple[int, ...] = (8, 200, 1100), batch: int = 8,
                lookahead: bool = False) -> float:
        """Capture the step at every batch bucket up to WARM_BATCH's (on a GPU), then run
        what serving runs: first syncs of several lengths, then steps that bring 1
        (the second one samples, when the group has several rows), a few more than a
        catch-up and several catch-ups' worth of new units (after a step the verify
        service decoded without the draft), then (lookahead) a lookahead's candidates;
        one sequence at a time, a batch, and on a GPU every batch bucket up to
        WARM_BATCH's (as long as half the pages allow), so that compiles and captures
        (seconds each on a GPU) happen before serving, not in a step the verify service
        waits for. Sequences get ids no engine hands out (< 0) and are released, leaving
        no state or page. Returns the seconds taken."""
        t0 = time.perf_counter()
        gpu = self.cache.device.type == "cuda"
        if gpu:
            self.graphs.capture_all(WARM_BATCH,
                                    budget_depths(self.env)[1:] if self.levels else ())
        groups = [[n] for n in lengths] + [[lengths[0]] * batch]
        if gpu:
            room = self.cache.blocks.num_blocks * self.cache.block_size // 2
            groups += [[min(lengths[-1], room // b - self._scratch)] * b
                       for b in BATCH_BUCKETS
                       if 1 < b <= WARM_BATCH and room // b - self._scratch >= 2]
        c = self.graphs.catch_up_len
        for g, sizes in enumerate(groups):
            ids = [-1000 * (g + 1) - i for i in range(len(sizes))]
            tokens = {sid: [1] * n for sid, n in zip(ids, sizes)}
            for sid, toks in tokens.items():
                self.update(sid, toks, len(toks), [], None)
            self.propose(ids)
            for k in (1, c + 3, 3 * c + 5):
                for sid in ids:
                    tokens[sid] = tokens[sid] + [1] * k
                    self.update(sid, tokens[sid], k, [], None)
                sampled = None if len(ids) == 1 or k > 1 else [  # both drafting ways
                    RowSampling(SamplingParams(temperature=1.0), rejection=bool(i % 2))
                    for i in range(len(ids))]
                self.propose(ids, sampled)
            if lookahead:       # its eager forwards (EAGLE-3's guesses) at this batch
                trees = self.propose(ids)
                draft_candidates(self, [Row(sid, tokens[sid], t, p, None) for sid, t, p in zip(
                    ids, trees.tokens.tolist(), trees.parents.tolist())], 1, None)
            for sid in ids:
                self.release(sid)
        if gpu:
            from treespec.kernels.triton_common import log_compiles
            log_compiles(log)
        return time.perf_counter() - t0
