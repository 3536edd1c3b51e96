"""The verify engine: continuous batching of speculative decoding.

Each loop iteration (1) admits waiting requests, (2) prefills the next chunks of the
prompts not yet written (at most --prefill-tokens in one forward), and (3) runs one
decode step over the sequences past their prefill: schedule (the draft's trees for the
rows the controller asks: verify_service/scheduler.py), run (ONE target forward over
[root, nodes] of every sequence, the accept walk and the KV commit) and postprocess
(commit and stream 1..depth+1 tokens each, greedy or each request's seeded draw:
common/spec/sampling.py). A missing, late or broken proposal turns the step into plain
decode: output never changes.

Prefix caching (on unless ``prefix_caching=False``; common/runtime/prefix_cache.py): a
request starts from the KV pages of its prompt's longest cached prefix (full pages, at
least the last prompt token left to prefill) and prefills the rest; each sequence's pages
join the cache once full and committed (prompt pages after prefill, generated ones as
they fill), and stay cached after it ends until their space is needed. A sequence whose
drafter reads the target's hidden states (EAGLE-3, DFlash) reuses only as much of a
cached prefix as the draft holds its own state of (``Drafter.prefix_held``): the draft
takes that prefix from its cache, and only the states of the rest cross.

The draft is reached through a ``Drafter`` (verify_service/drafter.py); the engine
never sees its carrier. All state is touched only on the event loop; compute runs
where treespec.verify_service.step_runner puts it (a worker thread, or the loop when busy
polling).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque


from treespec.common.spec import sampling
from treespec.common.serving.aio import cancel_and_wait
from treespec.common.serving.errors import InvalidRequest, Overloaded, Unavailable
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.runtime.row_buffer import RowBuffer
from treespec.kernels.dispatch import select
from treespec.verify_service.controller import Controller
from treespec.verify_service.drafter import Drafter
from treespec.verify_service.observer import (PLANNED_PLAIN, CommittedRow, EngineObserver,
                                              NullObserver, step_record)
from treespec.verify_service.request import GenRequest, check_request
from treespec.verify_service.scheduler import ScheduledStep, StepScheduler
from treespec.verify_service.sequence import Sequence
from treespec.verify_service.step_runner import StepRunner
from treespec.verify_service.verifier import StepResult, Verifier

log = logging.getLogger("treespec.verify.engine")


class VerifyEngine:
    def __init__(self, model: Qwen3Model, num_blocks: int, block_size: int, max_batch: int,
                 max_model_len: int, prefill_tokens: int, link: Drafter | None = None,
                 kernels: str = "auto", busy_poll: bool = False,
                 observer: EngineObserver | None = None,
                 sampling_defaults: dict | None = None, max_waiting: int = 1024,
                 speculation: str = "adaptive", prefix_caching: bool = True) -> None:
        self.spec = model.spec
        self.cache = model.new_cache(num_blocks, block_size, prefix_caching)
        self.verifier = Verifier(model, self.cache, select(model.device, kernels), True, max_batch)
        self.runner = StepRunner(self.verifier, busy_poll)
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.max_model_len = max_model_len or model.spec.max_position
        self.prefill_tokens, self.link = prefill_tokens, link
        self.controller = Controller(speculation)      # how much each step speculates
        self.scheduler = StepScheduler(self.verifier, self.controller, link,
                                       model.spec.vocab_size)
        self.sampling_defaults = sampling_defaults or {}   # for fields a request leaves unset
        self.observer: EngineObserver = observer or NullObserver()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.fallbacks: Counter[str] = Counter()
        self.lookahead: Counter[str] = Counter()     # sequence-steps: "hits", "misses"
        self.limits: Counter[str] = Counter()     # times a request waited, by limiting flag
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def kv_pages_used(self) -> int:
        """Pages held by sequences (the verifier's own scratch page excluded; cached
        pages no sequence holds are not: ``kv_pages_cached``)."""
        return self.cache.blocks.num_used - self.verifier.reserved_pages

    @property
    def kv_pages_cached(self) -> int:
        """Pages held by no sequence, kept for the prefixes they cache."""
        return 0 if self.cache.prefix is None else self.cache.prefix.num_cached

    # ------------------------------------------------------------------ client side

    def submit(self, req: GenRequest) -> Sequence:
        """Queue a request; its StepOutputs arrive on the returned sequence's queue."""
        if self._stopping:
            raise Unavailable("the verify service is shutting down")
        self._check(req)
        if len(self.waiting) >= self.max_waiting:
            raise Overloaded(f"{len(self.waiting)} requests wait already (--max-waiting); "
                             "retry later")
        stop = set(req.stop_token_ids)
        if not req.ignore_eos:
            stop |= set(self.spec.eos_token_ids)
        seq = Sequence(req, frozenset(stop), self.max_model_len,
                       sampling.resolve(req.sampling, self.sampling_defaults))
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
            seq.aborted = seq.finish is None
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
                if self.link is not None:
                    await self.link.idle()
                await self._wake.wait()
                continue
            try:
                info = self.link.info if self.link is not None else None
                if info is not None and self.verifier.use_draft(
                        info.target_hidden_layers, self.controller.shapes(info.envelope)):
                    log.info("verify warm-up for the draft's budgets took %.1f s",
                             await self.runner.compute(self.verifier.warm_up))
                await self._admit()
                await self._prefill()
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
                seq.finish = "abort" if seq.aborted else "cancelled"
                self.observer.finished(seq)
                seq.emit([])
            self.cache.release(seq.pages)
            self.controller.forget(seq.seq_id)
            if self.link is not None:
                self.link.release([seq.seq_id])
        self.running = keep
        for seq in [s for s in self.waiting if s.cancelled or force]:
            self.waiting.remove(seq)
            seq.finish = "abort" if seq.aborted else "cancelled"
            self.observer.finished(seq)
            seq.emit([])

    async def _admit(self) -> None:
        """Move waiting requests into the batch while slots and KV pages allow (all the
        pages a request may need, reserved now); _prefill then writes their prompts."""
        while self.waiting:
            if len(self.running) >= self.max_batch:
                self._limited("--max-batch", f"{self.max_batch} sequences already run")
                break
            seq = self.waiting[0]
            need = self._pages_for(seq.req)
            hit = self.cache.cached_prefix(seq.pages, seq.tokens)
            if hit and seq.speculative and self.verifier.capture_layers:
                hit = hit[:self._draft_held(seq, len(hit))]
            taken = self.cache.prefix.unheld(hit) if hit else 0    # cached pages it would hold
            if need - len(hit) + taken > self.cache.blocks.num_free:
                self._limited("--num-blocks", f"{self.cache.blocks.num_free} of "
                              f"{self.cache.blocks.num_blocks} KV pages are free")
                break
            self.waiting.popleft()
            if self.cache.prefix is not None:
                seq.stats.cached_tokens = self.cache.take_prefix(seq.pages, hit, len(seq.tokens))
            self.cache.reserve(seq.pages, need * self.cache.block_size)
            # running from here on, so a failed prefill is reaped (pages back, clients told)
            self.running.append(seq)

    def _draft_held(self, seq: Sequence, pages: int) -> int:
        """How many of seq's first cached pages it may reuse when its drafter reads the
        target's hidden states (a reused prefix has none): those whose states the draft
        holds in its own prefix cache, ending on a page boundary of both services."""
        info = self.link.info
        draft_bs = info.prefix_block_size if info is not None else 0
        if not draft_bs:
            return 0
        bs = self.cache.block_size
        whole = math.lcm(bs, draft_bs) // bs
        return self.link.prefix_held(seq.pages.keys[:pages]) // whole * whole

    async def _prefill(self) -> None:
        """One forward over the next chunks of the prompts being prefilled, oldest first,
        at most --prefill-tokens tokens in all: a long prompt takes several iterations,
        each beside a decode step of the running sequences, so no prompt stalls the
        others or holds a forward's memory for all its tokens at once. A prompt whose
        last chunk ran commits its first token."""
        chunks: list[tuple[Sequence, list[int]]] = []
        budget = self.prefill_tokens
        for seq in self.running:
            if budget and seq.prefilling and not seq.cancelled:
                start = seq.pages.kv_len
                n = min(seq.stats.prompt_tokens - start, budget)
                chunks.append((seq, seq.tokens[start:start + n]))
                budget -= n
        if not chunks:
            return
        t0 = time.time_ns()
        firsts, feats = await self.runner.compute(
            self.verifier.prefill, [s.pages for s, _ in chunks], [c for _, c in chunks],
            [s.sampling for s, _ in chunks])
        done = []
        for i, (seq, chunk) in enumerate(chunks):
            rows = feats[i] if feats is not None and seq.speculative else None
            if rows is None:
                seq.hidden = None
            elif seq.pages.kv_len - len(chunk) == seq.stats.cached_tokens:   # its first
                seq.hidden, seq.hidden_from = RowBuffer(rows), seq.stats.cached_tokens
            elif seq.hidden is not None:
                seq.hidden.append(rows)
            self.cache.register(seq.pages, seq.tokens)
            if not seq.prefilling:
                seq.emit(seq.commit([firsts[i]]))
                done.append(seq)
        if done:
            self.observer.prefilled(done, t0, time.time_ns())
        for seq in done:
            if seq.finish is not None:
                self.observer.finished(seq)

    def _limited(self, flag: str, why: str) -> None:
        """A request waits for a configured limit: say so (the first time, then rarely)."""
        self.limits[flag] += 1
        if self.limits[flag] in (1, 1000) or self.limits[flag] % 100000 == 0:
            log.warning("a request waits: %s (%d times so far); %s raises the limit", why,
                        self.limits[flag], flag)

    async def _step(self) -> None:
        """One decode step: schedule -> run -> postprocess; meanwhile the draft takes in
        the prompts' hidden states it lacks (_catch_up)."""
        seqs = [s for s in self.running
                if s.finish is None and not s.cancelled and not s.prefilling]
        if not seqs:
            await self._catch_up()
            return
        self.observer.step_started(seqs)
        step = await self.scheduler.schedule(seqs, self.observer)   # rows, plan, trees
        await self._catch_up()
        result = await self.runner.step(step.batch)     # one target forward, accept, commit KV
        self._postprocess(step, result)                 # stream, count, teach the controller

    async def _catch_up(self) -> None:
        """Send the draft the hidden states of prompts still crossing (prefilling ones as
        far as prefilled), in a request no step waits for (DraftLink.catch_up): a prompt
        has crossed about when its prefill ends, and the draft's intake of it overlaps
        the target's forwards instead of delaying a step's answer."""
        if self.link is None or not self.verifier.capture_layers:
            return
        await self.link.catch_up([
            s for s in self.running if s.speculative and s.hidden is not None
            and s.finish is None and not s.cancelled
            and not self.scheduler.past_draft_limit(s)])

    def _postprocess(self, step: ScheduledStep, result: StepResult) -> None:
        t_verified = time.time_ns()
        rows = self._commit(step, result)
        self._teach_controller(step, result)
        self.lookahead["hits"] += step.drafted.lookahead_hits
        self.lookahead["misses"] += step.drafted.lookahead_misses
        if isinstance(self.observer, NullObserver):
            return                       # telemetry off: not even a record is built
        envelope = self.link.info.envelope if step.batch.trees is not None else None
        self.observer.step_finished(step_record(
            step.drafted, step.plan, len(step.seqs), rows, step.fallback, envelope,
            (step.t_start, step.t_drafted, t_verified, time.time_ns())))
        for row in rows:
            if row.seq.finish is not None:
                self.observer.finished(row.seq)

    def _commit(self, step: ScheduledStep, result: StepResult) -> list[CommittedRow]:
        """Commit each sequence's accepted path and bonus token and stream them; returns
        a row per sequence still running."""
        trees = step.batch.trees
        tokens = trees.tokens.tolist() if trees is not None else None
        offered = trees.num_valid() if trees is not None else [0] * len(step.seqs)
        rows: list[CommittedRow] = []
        for i, s in enumerate(step.seqs):
            if s.cancelled:
                continue
            path = result.accepted[i]
            kept = s.commit([tokens[i][j] for j in path] + [result.bonus[i]])
            s.stats.steps += 1
            s.stats.draft_tokens += offered[i]
            s.stats.accepted_tokens += min(len(path), len(kept))
            if s.speculative and offered[i] == 0:
                self._count_plain(s, step.fallback[s.seq_id])
            s.accepted_path = path if step.index is None else step.index[i][path].tolist()
            rows.append(CommittedRow(s, offered[i], len(path), min(len(path), len(kept)),
                                     len(kept)))
            if result.hidden is not None and s.hidden is not None:
                s.hidden.append(result.hidden[i])
            elif result.hidden is None:
                s.hidden = None
            self.cache.register(s.pages, s.tokens)
            s.emit(kept)
        return rows

    def _count_plain(self, s: Sequence, why: str) -> None:
        """A speculating sequence's step ran plain: the controller's choice, or a fallback
        (logged the first times, then rarely)."""
        self.fallbacks[why] += 1
        if why == PLANNED_PLAIN:
            s.stats.planned_plain_steps += 1
            return
        s.stats.fallback_steps += 1
        n = self.fallbacks[why]
        if n in (1, 10, 100) or n % 10000 == 0:
            log.warning("plain decode instead of speculation (%s): %d sequence steps so far",
                        why, n)

    def _teach_controller(self, step: ScheduledStep, result: StepResult) -> None:
        """Tell the controller what its planned step did: each asked row's accepted length
        (0 when the draft was waited for and nothing usable came; -1 while syncing) and
        the step's time, unless a graph capture or a catch-up made it unlike a step."""
        drafted, plan = step.drafted, step.plan
        failed = drafted.fallback in ("deadline", "invalid_proposal")
        if not (failed or drafted.fallback in (None, PLANNED_PLAIN)):
            return                      # no draft, disconnected, busy: nothing was tried
        syncing = {plan.rows[j] for j in drafted.syncing}
        accepted = [0 if failed else -1 if i in syncing else len(result.accepted[i])
                    for i in plan.rows]
        unlike = result.captured or (drafted.catch_up and step.batch.trees is None)
        seconds = None if unlike else (time.time_ns() - step.t_start) * 1e-9
        self.controller.observe(plan, [s.seq_id for s in step.seqs], accepted, step.bucket,
                                seconds, drafted.catch_up, drafted.fresh)
