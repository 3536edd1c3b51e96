"""The draft engine: committed-token bookkeeping around one Proposer. No grpc here.

The verify service is the authority on committed tokens; this engine keeps a
cache of them per sequence and checks every update against it:

* ``full`` update: the sequence restarts from ``new_tokens`` (the whole list);
* otherwise the sequence must be known and ``len(known) + len(new_tokens) ==
  committed_len``. If not, its state is dropped, its row is all padding and its
  id goes into ``SpecResponse.resync`` (the verify side then sends ``full``);
* ``accepted_nodes`` reach the proposer only when ``accepted_step_id`` names the
  step whose tree this engine emitted for that sequence last; otherwise the
  proposer recomputes;
* a ``full`` update of a sampling request carries its parameters and acceptance
  (rejection sampling or coupled), kept for the proposer (unless
  ``--draft-sampling deterministic``);
* a ``full`` update naming a cached prefix (``cached_len``: the verify reused its KV
  and has no hidden states of it) starts from the proposer's own cached state of it
  (``take_prefix``); a proposer that lacks it drops the sequence, whose id goes into
  ``SpecResponse.lost_prefix`` (no update could bring that state back);
* ``released`` ids are forgotten before the batch is processed; past
  ``max_sequences`` the least recently used state is evicted (it will resync).

Malformed requests raise InvalidRequest (see ``check_request``): they are bugs
in the caller, not state drift, and a resync would not fix them.

Example: step 7 sends seq 3 ``full`` with ``[1, 2, 3]`` (committed_len 3); the
draft proposes off root 3. Step 8 sends ``new_tokens [9, 4]``, committed_len 5,
accepted_nodes [0] of step 7: the engine appends, the proposer keeps node 0's
work. Had step 8 said committed_len 6, seq 3 would come back in ``resync``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from treespec.common.serving.errors import InvalidRequest
from treespec.common.spec.messages import (DrafterInfo, Lookahead, SeqUpdate, SpecRequest,
                                           SpecResponse)
from treespec.common.spec.tree import TreeBatch, TreeEnvelope
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.lookahead import Row, draft_candidates
from treespec.draft_service.observer import DraftObserver, DraftStepRecord, NullDraftObserver
from treespec.draft_service.proposer import Proposer, RowSampling
from treespec.draft_service.registry import build_proposer

log = logging.getLogger(__name__)

# a step slower than this is logged with what it carried (the first, the 10th, every
# 1000th and any over a second; a verify service waits 100 ms by default before it
# decodes the step without a tree)
SLOW_STEP_MS = 50.0
# sequences one request may carry (or --max-sequences, if larger): a batch past the
# sequences the draft keeps evicts the oldest, past this it is refused unread
MAX_REQUEST_SEQS = 1024


@dataclass
class _SeqState:
    tokens: list[int]               # committed tokens, prompt included
    tree_step: int | None = None    # step id of the last tree emitted for it
    sampling: RowSampling | None = None  # a sampling request's, from its full update
    tree: tuple[list[int], list[int]] | None = None   # the tree verified this step
    # lookahead: the step whose outcome the candidates guess, and per candidate its tree
    cand_step: int | None = None
    cands: list[tuple[list[int], list[int]]] = field(default_factory=list)


def check_request(req: SpecRequest, env: TreeEnvelope, vocab_size: int,
                  max_sequences: int = 1 << 30, max_len: int = 1 << 30) -> None:
    """Raise InvalidRequest if req is malformed (whatever the engine's state).

    Malformed: more sequences than max_sequences, a committed_len over max_len, a
    duplicate seq_id, committed_len < 1 (a tree needs a root), a ``full`` update whose
    new_tokens are not committed_len long, a token outside [0, vocab_size) (any token
    >= 0 when vocab_size is 0), more accepted nodes than the envelope's depth or one
    outside [0, num_nodes).
    """
    if len(req.seqs) > max_sequences:
        raise InvalidRequest(f"step {req.step_id}: {len(req.seqs)} sequences, the draft takes "
                             f"at most {max_sequences} in one request")
    seen: set[int] = set()
    for u in req.seqs:
        where = f"step {req.step_id}, seq {u.seq_id}"
        if u.committed_len > max_len:
            raise InvalidRequest(f"{where}: committed_len {u.committed_len} over the draft's "
                                 f"--max-model-len {max_len}")
        if u.seq_id in seen:
            raise InvalidRequest(f"{where}: sequence appears twice in one request")
        seen.add(u.seq_id)
        if u.committed_len < 1:
            raise InvalidRequest(f"{where}: committed_len {u.committed_len} < 1")
        if u.full and len(u.new_tokens) != u.committed_len:
            raise InvalidRequest(f"{where}: a full update has {len(u.new_tokens)} tokens "
                                 f"but committed_len {u.committed_len}")
        if u.cached_len and not (u.full and u.cached_len < u.committed_len):
            raise InvalidRequest(f"{where}: cached_len {u.cached_len} on a "
                                 f"{'full' if u.full else 'partial'} update of "
                                 f"committed_len {u.committed_len}")
        if u.new_tokens and (min(u.new_tokens) < 0
                             or (vocab_size and max(u.new_tokens) >= vocab_size)):
            raise InvalidRequest(f"{where}: a token is outside the vocabulary "
                                 f"[0, {vocab_size or 'any'})")
        if len(u.accepted_nodes) > env.depth or any(
                not 0 <= n < env.num_nodes for n in u.accepted_nodes):
            raise InvalidRequest(f"{where}: accepted_nodes {u.accepted_nodes} do not fit "
                                 f"depth {env.depth} / {env.num_nodes} nodes")


def projected_width(p: Proposer) -> int:
    """DrafterInfo.projected_width: 0 where a projected row could not be told apart."""
    proj = getattr(p, "projection", None)
    return 0 if proj is None or proj.shape[0] == proj.shape[1] else proj.shape[0]


class DraftEngine:
    def __init__(self, cfg: DraftConfig, proposer: Proposer | None = None,
                 observer: DraftObserver | None = None) -> None:
        self.cfg = cfg
        self.env = cfg.envelope
        self.proposer = proposer if proposer is not None else build_proposer(cfg)
        self._seqs: OrderedDict[int, _SeqState] = OrderedDict()
        self._slow = 0                  # steps slower than SLOW_STEP_MS
        self.observer: DraftObserver = observer or NullDraftObserver()
        self.lookahead_k = cfg.lookahead if getattr(self.proposer, "lookahead", False) else 0
        if cfg.lookahead and not self.lookahead_k:
            log.warning("--lookahead %d: the %s drafter does not pre-draft (its guesses' "
                        "trees lost more tokens than their hits saved: docs/design.md, "
                        "Lookahead); drafting when asked", cfg.lookahead, self.proposer.name)

    @property
    def info(self) -> DrafterInfo:
        p = self.proposer
        return DrafterInfo(envelope=self.env, vocab_size=p.vocab_size, proposer=p.name,
                           target_hidden_layers=tuple(p.target_hidden_layers), model=p.model,
                           max_model_len=self.cfg.max_model_len,
                           projected_width=projected_width(p), lookahead=self.lookahead_k,
                           prefix_block_size=getattr(p, "prefix_block_size", 0))

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def release(self, seq_ids: list[int]) -> None:
        """Forget these sequences (unknown ids are fine)."""
        for s in seq_ids:
            self._seqs.pop(s, None)
            self.proposer.release(s)

    def step(self, req: SpecRequest) -> SpecResponse:
        """Apply req's updates and propose one tree per sequence, in request order."""
        t0 = time.time_ns()
        tp0 = tp1 = 0
        check_request(req, self.env, self.proposer.vocab_size,
                      max(MAX_REQUEST_SEQS, self.cfg.max_sequences), self.cfg.max_model_len)
        self.release(req.released)
        if not req.seqs:                # only news of ended sequences: not a step
            return SpecResponse(req.step_id, [], TreeBatch.padding(0, self.env.num_nodes), [])
        ids = [u.seq_id for u in req.seqs]
        try:
            self._stage_hidden(req.seqs)
            lost: list[int] = []
            live = [r for r, u in enumerate(req.seqs) if self._apply(u, lost)]
            evicted = self._evict()
            live = [r for r in live if ids[r] not in evicted]
            trees = TreeBatch.padding(len(ids), self.env.num_nodes)
            hits = {r: self._hit(req.seqs[r]) for r in live if req.seqs[r].lookahead_hit}
            drafting = [r for r in live if r not in hits]
            if drafting:
                tp0 = time.time_ns()
                trees = self.proposer.propose(
                    [ids[r] for r in drafting], self._sampling([ids[r] for r in drafting]),
                    **self._shallow(req))
                trees = trees.scatter(drafting, len(ids))
                if 0 < req.max_depth < self.env.depth:      # the rest will not be verified
                    trees = trees.pruned(req.max_depth)
                tp1 = time.time_ns()
        except Exception:
            self.release(ids)   # never leave a half-applied state behind
            raise
        rows_t, rows_p = trees.tokens.tolist(), trees.parents.tolist()
        for r in live:
            st = self._seqs[ids[r]]
            st.tree_step = req.step_id
            st.tree = hits[r] if r in hits else (rows_t[r], rows_p[r])
            st.cand_step, st.cands = None, []
        live_set = set(live)
        resync = [s for r, s in enumerate(ids) if r not in live_set and s not in lost]
        if resync:
            log.debug("step %d: resync %s", req.step_id, resync)
        resp = SpecResponse(req.step_id, ids, trees, resync, lost)
        took = (time.time_ns() - t0) / 1e6
        if took > SLOW_STEP_MS:
            self._slow += 1
            if took > 20 * SLOW_STEP_MS or self._slow in (1, 10) or self._slow % 1000 == 0:
                log.info("step %d took %.0f ms (proposer %.0f ms): %d sequences, %d new "
                         "tokens (%d steps over %.0f ms so far)", req.step_id, took,
                         (tp1 - tp0) / 1e6, len(ids), sum(len(u.new_tokens) for u in req.seqs),
                         self._slow, SLOW_STEP_MS)
        self.observer.step_finished(DraftStepRecord(req, resp, t0, tp0, tp1, time.time_ns()))
        return resp

    def _shallow(self, req: SpecRequest) -> dict:
        """propose()'s depth for a levels drafter the request wants shallower."""
        return {"depth": req.max_depth} if getattr(self.proposer, "levels", False) \
            and 0 < req.max_depth < self.env.depth else {}

    def _hit(self, u: SeqUpdate) -> tuple[list[int], list[int]] | None:
        """The candidate tree the verify service says it verifies this step (None: one
        this engine no longer has, e.g. after a resync or eviction: no lookahead then)."""
        st = self._seqs[u.seq_id]
        k = u.lookahead_hit - 1
        if st.cand_step is None or st.cand_step != u.accepted_step_id or k >= len(st.cands):
            return None
        return st.cands[k]

    def lookahead(self, req: SpecRequest) -> Lookahead | None:
        """Candidates for the step after req, which this engine just answered (None:
        none asked, or this drafter does not pre-draft; where asked, always an answer,
        with no candidates if need be: the next step waits for it). Runs while the
        verify service verifies req's step."""
        if not (self.lookahead_k and any(u.lookahead for u in req.seqs)):
            return None
        none = Lookahead(req.step_id, [], TreeBatch.padding(0, self.env.num_nodes),
                         torch.zeros(0, self.env.depth + 1, dtype=torch.int32))
        rows = []
        for u in req.seqs:
            st = self._seqs.get(u.seq_id)
            if (u.lookahead and st is not None and st.tree is not None
                    and st.tree_step == req.step_id
                    and not (st.sampling is not None and st.sampling.rejection)):
                sampling = self._sampling([u.seq_id])
                rows.append(Row(u.seq_id, st.tokens, *st.tree, sampling and sampling[0]))
        if not rows:
            return none
        k = self.lookahead_k
        # a probe one level deeper than the step's trees, where the envelope allows
        probe = None
        if getattr(self.proposer, "levels", False) and 0 < req.max_depth < self.env.depth:
            probe = {"depth": req.max_depth + 1} if req.max_depth + 1 < self.env.depth else {}
        own = getattr(self.proposer, "draft_candidates", None)   # an instrument's own
        try:
            keys, trees = own(rows, k) if own else draft_candidates(self.proposer, rows, k,
                                                                    probe)
        except Exception:       # costs the lookahead only: these sequences resync
            log.exception("lookahead after step %d failed", req.step_id)
            self.release([r.seq_id for r in rows])
            return none
        if 0 < req.max_depth < self.env.depth:
            trees = trees.pruned(req.max_depth)
        tt, pp = trees.tokens.tolist(), trees.parents.tolist()
        for b, r in enumerate(rows):
            st = self._seqs[r.seq_id]
            st.cand_step = req.step_id
            st.cands = [(tt[b * k + j], pp[b * k + j]) for j in range(k)]
        return Lookahead(req.step_id, [r.seq_id for r in rows], trees, keys)

    def _stage_hidden(self, updates: list[SeqUpdate]) -> None:
        """The updates' hidden rows onto the drafter's device, copies issued together
        and waited for once (from the carrier's pinned buffer a copy is DMA, and the
        carrier reuses that buffer once it has the answer); rows that came as the
        target's layers then go through the proposer's projection in one product for
        the request (a product per sequence would read its weight once a sequence).
        Projected rows, and any update() will refuse, pass as they are."""
        proj = getattr(self.proposer, "projection", None)
        if proj is None:
            return
        rows = [u for u in updates if u.hidden is not None and u.hidden.dim() == 2
                and u.hidden.shape[1] in proj.shape]
        host = [u for u in rows if u.hidden.device.type == "cpu"]
        if host and proj.device.type == "cuda":
            for u in host:
                u.hidden = u.hidden.to(proj.device, proj.dtype, non_blocking=True)
            torch.cuda.current_stream(proj.device).synchronize()
        raw = [u for u in rows if u.hidden.shape[1] == proj.shape[1]]
        if not raw or not projected_width(self.proposer):
            return
        out = torch.nn.functional.linear(
            torch.cat([u.hidden.to(proj.device, proj.dtype) for u in raw]), proj)
        for u, part in zip(raw, out.split([u.hidden.shape[0] for u in raw])):
            u.hidden = part

    def _apply(self, u: SeqUpdate, lost: list[int]) -> bool:
        """Bring one sequence up to date; False if it must resync, or (its id added to
        lost) if its cached prefix is not here."""
        if u.full:
            self.release([u.seq_id])
            st = self._seqs[u.seq_id] = _SeqState(
                list(u.new_tokens),
                sampling=RowSampling(u.sampling, u.rejection) if u.sampling else None)
            if not u.cached_len:
                self.proposer.update(u.seq_id, st.tokens, len(st.tokens), [], u.hidden)
                return True
            take = getattr(self.proposer, "take_prefix", None)
            if take is not None and take(u.seq_id, st.tokens, u.cached_len, u.hidden):
                return True
            self.release([u.seq_id])
            lost.append(u.seq_id)
            return False
        st = self._seqs.get(u.seq_id)
        if st is None or len(st.tokens) + len(u.new_tokens) != u.committed_len:
            self.release([u.seq_id])
            return False
        self._seqs.move_to_end(u.seq_id)
        st.tokens.extend(u.new_tokens)
        fresh = st.tree_step is not None and u.accepted_step_id == st.tree_step
        st.tree_step = None
        self.proposer.update(u.seq_id, st.tokens, len(u.new_tokens),
                             u.accepted_nodes if fresh else [], u.hidden)
        return True

    def _sampling(self, seq_ids: list[int]) -> list[RowSampling | None] | None:
        """Each row's sampling (None: greedy), or None when no row samples or the
        drafter is to draft every row as greedy (--draft-sampling deterministic)."""
        rows = [self._seqs[s].sampling for s in seq_ids]
        if self.cfg.draft_sampling == "deterministic" or all(p is None for p in rows):
            return None
        return rows

    def _evict(self) -> set[int]:
        """Drop least recently used states beyond max_sequences."""
        evicted: set[int] = set()
        while len(self._seqs) > self.cfg.max_sequences:
            s = next(iter(self._seqs))
            self.release([s])
            evicted.add(s)
        return evicted
