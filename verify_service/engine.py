"""The verify engine: continuous batching of greedy speculative decoding.

Each loop iteration (1) admits waiting requests and prefills them in one forward,
(2) asks the draft for one tree per running sequence (one message for the batch),
and (3) runs ONE target forward over [root, nodes] of every running sequence,
accepting, committing and streaming 1..depth+1 tokens each. A missing, late or
broken proposal turns the step into plain decode: output never changes.

All state is touched only on the event loop; compute runs where
verify_service.step_runner puts it (a worker thread, or the loop when busy polling).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque

from common.aio import cancel_and_wait
from common.codec import Staging
from common.errors import InvalidRequest, Unavailable
from common.qwen3 import Qwen3Model
from common.spec_types import SeqUpdate, SpecRequest, TreeBatch
from common.tree import validate_tree
from kernels.dispatch import select
from verify_service.draft_link import DraftLink, Fallback
from verify_service.graph_verifier import GraphVerifier
from verify_service.observer import EngineObserver, NullObserver, StepRecord, hop_parts
from verify_service.hidden_states import HiddenBuffer, hidden_rows_for
from verify_service.request import GenRequest, check_request
from verify_service.sequence import Sequence, batch_trees
from verify_service.step_runner import StepRunner
from verify_service.verifier import Verifier

log = logging.getLogger("treespec.verify.engine")


class VerifyEngine:
    def __init__(self, model: Qwen3Model, num_blocks: int, block_size: int, max_batch: int,
                 max_model_len: int, prefill_tokens: int, step_deadline_s: float,
                 link: DraftLink | None = None, kernels: str = "auto",
                 step_mode: str = "auto", busy_poll: bool = False, rehearse: bool = False,
                 observer: EngineObserver | None = None) -> None:
        self.model = model
        self.spec = model.spec
        self.cache = model.new_cache(num_blocks, block_size)
        ops = select(model.device, kernels)
        fixed = step_mode == "fixed" or (step_mode == "auto" and model.device.type == "cuda")
        self.verifier = GraphVerifier(model, self.cache, ops) if fixed else \
            Verifier(model, self.cache, ops)
        self.runner = StepRunner(self.verifier, busy_poll,
                                 link.rehearse if link is not None and rehearse else None)
        self.max_batch = max_batch
        self.max_model_len = max_model_len or model.spec.max_position
        self.prefill_tokens = prefill_tokens
        self.step_deadline_s = step_deadline_s
        self.link = link
        self.observer: EngineObserver = observer or NullObserver()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.released: list[int] = []
        self.fallbacks: Counter[str] = Counter()
        self._step_id = 0
        self._epoch = 0
        self._wake = asyncio.Event()
        self._staging = Staging()
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def kv_pages_used(self) -> int:
        """Pages held by sequences (the verifier's own scratch page excluded)."""
        return self.cache.blocks.num_used - self.verifier.reserved_pages

    # ------------------------------------------------------------------ client side

    def submit(self, req: GenRequest) -> Sequence:
        """Queue a request; its StepOutputs arrive on the returned sequence's queue."""
        if self._stopping:
            raise Unavailable("the verify service is shutting down")
        self._check(req)
        stop = set(req.stop_token_ids)
        if not req.ignore_eos:
            stop |= set(self.spec.eos_token_ids)
        seq = Sequence(req, frozenset(stop), self.max_model_len)
        self.waiting.append(seq)
        self.observer.submitted(seq)
        self._wake.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Stop a request; its pages return at the next iteration boundary."""
        if seq.finish is None:
            seq.cancelled = True
            self._wake.set()

    def _check(self, req: GenRequest) -> None:
        check_request(req, self.spec.vocab_size, self.max_model_len)
        if self._pages_for(req) > self.cache.blocks.num_blocks:
            raise InvalidRequest("prompt + max_tokens need more KV pages than the service has")

    def _pages_for(self, req: GenRequest) -> int:
        n = self.link.info.envelope.num_nodes if self.link and self.link.info else 64
        total = min(len(req.prompt_ids) + req.max_tokens, self.max_model_len) + n + 1
        return self.cache.blocks.blocks_for(total)

    # ------------------------------------------------------------------ the loop

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, let running ones finish for up to timeout_s, then stop."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while (self.waiting or self.running) and loop.time() < end:
            await asyncio.sleep(0.05)
        await self.stop()

    async def stop(self) -> None:
        """Finish nothing new; cancel what runs; return every page."""
        self._stopping = True
        for seq in list(self.waiting) + self.running:
            self.cancel(seq)
        self._wake.set()
        await cancel_and_wait(self._task)
        self._reap(force=True)
        await self.runner.close()
        self.observer.close()

    async def _loop(self) -> None:
        while True:
            self._reap()
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                self._follow_link()
                await self._admit()
                if self.running:
                    await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.exception("engine iteration failed; failing its requests")
                for seq in self.running:
                    seq.cancelled = True
                    seq.error = f"the engine failed this request: {type(e).__name__}: {e}"
            await asyncio.sleep(0)

    def _reap(self, force: bool = False) -> None:
        """Free finished and cancelled sequences and tell their owners."""
        keep: list[Sequence] = []
        for seq in self.running:
            if seq.finish is None and not seq.cancelled and not force:
                keep.append(seq)
                continue
            if seq.finish is None:
                seq.finish = "cancelled"
                self.observer.finished(seq)
                seq.emit([])
            self.cache.release(seq.pages)
            if seq.draft_synced:
                self.released.append(seq.seq_id)
        self.running = keep
        for seq in [s for s in self.waiting if s.cancelled or force]:
            self.waiting.remove(seq)
            seq.finish = "cancelled"
            self.observer.finished(seq)
            seq.emit([])

    async def _admit(self) -> None:
        batch: list[Sequence] = []
        budget = self.prefill_tokens
        while self.waiting and len(self.running) + len(batch) < self.max_batch:
            seq = self.waiting[0]
            need = self._pages_for(seq.req)
            if batch and len(seq.tokens) > budget:
                break
            if need > self.cache.blocks.num_free:
                break
            self.waiting.popleft()
            self.cache.reserve(seq.pages, need * self.cache.block_size)
            budget -= len(seq.tokens)
            batch.append(seq)
        if not batch:
            return
        # running from here on, so a failed prefill is reaped (pages back, clients told)
        self.running.extend(batch)
        t0 = time.time_ns()
        firsts, feats = await self.runner.compute(self.verifier.prefill, [s.pages for s in batch],
                                            [list(s.tokens) for s in batch])
        for i, (seq, tok) in enumerate(zip(batch, firsts)):
            seq.hidden = HiddenBuffer(feats[i]) if feats is not None else None
            kept = seq.commit([tok])
            seq.unsent = []          # the draft will hear the whole list at first sync
            seq.emit(kept)
        self.observer.prefilled(batch, t0, time.time_ns())
        for seq in batch:
            if seq.finish is not None:
                self.observer.finished(seq)

    def _follow_link(self) -> None:
        """On each new draft connection: resync every sequence and capture the target
        layers that drafter reads (before any prefill it will need them from)."""
        if self.link is None or not self.link.ready or self.link.epoch == self._epoch:
            return
        self._epoch = self.link.epoch
        self.released = []
        self.verifier.capture_layers = self.link.info.target_hidden_layers
        for s in self.running:
            s.draft_synced = False

    async def _propose(self, seqs: list[Sequence]) -> tuple[TreeBatch | None, Fallback | None]:
        if self.link is None:
            return None, "no_draft"
        if not self.link.ready:
            return None, "disconnected"
        self._step_id += 1
        updates = [SeqUpdate(seq_id=s.seq_id, committed_len=len(s.tokens),
                             new_tokens=list(s.unsent) if s.draft_synced else list(s.tokens),
                             full=not s.draft_synced, accepted_nodes=s.accepted_nodes,
                             accepted_step_id=s.accepted_step) for s in seqs]
        if self.verifier.capture_layers:
            for u, rows in zip(updates, hidden_rows_for(seqs, self._staging)):
                u.hidden = rows
        req = SpecRequest(self._step_id, updates, self.released,
                          trace_context=self.observer.draft_context())
        got = await self.link.propose(req, self.step_deadline_s)
        if isinstance(got, str):
            if got != "busy":
                self._mark_sent(seqs)    # it may have been applied: only deltas from here
            return None, got
        self._mark_sent(seqs)
        env = self.link.info.envelope
        why = validate_tree(got.tokens, got.parents, env.num_nodes, self.spec.vocab_size) \
            if len(got.seq_ids) == len(seqs) else "wrong number of rows"
        if why is None and got.seq_ids != [s.seq_id for s in seqs]:
            why = "rows are not in the request's order"
        if why is not None:
            log.warning("dropping an invalid proposal: %s", why)
            return None, "invalid_proposal"
        for s in seqs:
            if s.seq_id in got.resync:
                s.draft_synced = False
        return got, None

    def _observe_step(self, step_id: int, batch: int,
                      rows: list[tuple[Sequence, int, int, int, int]],
                      tree: TreeBatch | None, reason: Fallback | None,
                      t0: int, t1: int, t2: int) -> None:
        """Tell the observer what the step did; rows: (seq, drafted, depth, accepted, kept);
        step_id 0 when the draft was not asked."""
        if isinstance(self.observer, NullObserver):
            return                       # telemetry off: not even a record is built
        seqs = [r[0] for r in rows]
        self.observer.step_finished(StepRecord(
            step_id=step_id, batch=batch,
            seq_ids=[s.seq_id for s in seqs], request_ids=[s.req.request_id for s in seqs],
            drafted=[r[1] for r in rows], depth=[r[2] for r in rows],
            accepted=[r[3] for r in rows], committed=[r[4] for r in rows],
            fallback=[(reason or "empty_tree") if s.speculative and d == 0 else None
                      for s, d, *_ in rows],
            reason=reason, envelope=self.link.info.envelope if tree is not None else None,
            t_start=t0, t_drafted=t1, t_verified=t2, t_end=time.time_ns(),
            hop_parts=hop_parts(t0, t1, self.link.stamps) if step_id and self.link else {}))
        for s in seqs:
            if s.finish is not None:
                self.observer.finished(s)

    def _mark_sent(self, seqs: list[Sequence]) -> None:
        self.released = []
        for s in seqs:
            s.draft_synced = True
            s.unsent = []
            s.accepted_nodes = []
            s.accepted_step = self._step_id

    async def _step(self) -> None:
        seqs = [s for s in self.running if s.finish is None and not s.cancelled]
        if not seqs:
            return
        t0 = time.time_ns()
        self.runner.keep_hot()
        self.observer.step_started(seqs)
        # a drafter that reads hidden states can only serve sequences whose history
        # was captured (those admitted before it connected decode plainly)
        needs = bool(self.verifier.capture_layers)
        spec_seqs = [s for s in seqs if s.speculative and (s.hidden is not None or not needs)]
        tree: TreeBatch | None = None
        reason: Fallback | None = None
        if spec_seqs:
            tree, reason = await self._propose(spec_seqs)
        t1 = time.time_ns()
        tokens = parents = None
        depth = 0
        if tree is not None:
            tokens, parents = batch_trees(seqs, spec_seqs, tree)
            depth = self.link.info.envelope.depth
        step_id = self._step_id
        res = await self.runner.step([s.pages for s in seqs], [s.tokens[-1] for s in seqs],
                                     tokens, parents, depth)
        t2 = time.time_ns()
        rows: list[tuple[Sequence, int, int, int, int]] = []
        tok_l = tokens.tolist() if tokens is not None else None
        offered_l = (parents != -2).sum(1).tolist() if parents is not None else [0] * len(seqs)
        for i, s in enumerate(seqs):
            if s.cancelled:
                continue
            path = res.accepted[i]
            offered = offered_l[i]
            new = [tok_l[i][j] for j in path] + [res.bonus[i]]
            kept = s.commit(new)
            s.stats.steps += 1
            s.stats.draft_tokens += offered
            s.stats.accepted_tokens += min(len(path), len(kept))
            if s.speculative and offered == 0:
                s.stats.fallback_steps += 1
                why = reason or "empty_tree"
                self.fallbacks[why] += 1
                if self.fallbacks[why] in (1, 10, 100) or self.fallbacks[why] % 10000 == 0:
                    log.warning("plain decode instead of speculation (%s): %d sequence "
                                "steps so far", why, self.fallbacks[why])
            s.accepted_nodes = path
            rows.append((s, offered, len(path), min(len(path), len(kept)), len(kept)))
            if res.hidden is not None and s.hidden is not None:
                s.hidden.append(res.hidden[i])
            elif res.hidden is None:
                s.hidden = None
            s.emit(kept)
        asked = bool(spec_seqs) and reason not in ("no_draft", "disconnected")
        self._observe_step(step_id if asked else 0, len(seqs), rows, tree, reason, t0, t1, t2)

