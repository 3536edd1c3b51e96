"""The verify engine: continuous batching of speculative decoding.

Each loop iteration (1) admits waiting requests and prefills them in one forward,
(2) asks the draft for one tree per running sequence (one message for the batch),
and (3) runs ONE target forward over [root, nodes] of every running sequence,
accepting, committing and streaming 1..depth+1 tokens each (greedy, or each request's
seeded draw: common/spec/sampling.py). A missing, late or broken proposal turns the step
into plain decode: output never changes.

The draft is reached through a ``Drafter`` (verify_service/drafter.py); the engine
never sees its carrier. All state is touched only on the event loop; compute runs
where treespec.verify_service.step_runner puts it (a worker thread, or the loop when busy
polling).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque

import numpy as np

from treespec.common.spec import sampling
from treespec.common.serving.aio import cancel_and_wait
from treespec.common.serving.errors import InvalidRequest, Overloaded, Unavailable
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.runtime.row_buffer import RowBuffer
from treespec.common.runtime.graph_buckets import bucket
from treespec.common.spec.tree import TreeBatch, budget_nodes, cut_depth, validate_tree
from treespec.kernels.dispatch import select
from treespec.verify_service.controller import Controller, Plan
from treespec.verify_service.drafter import Drafted, Drafter
from treespec.verify_service.observer import EngineObserver, NullObserver, step_record
from treespec.verify_service.request import GenRequest, check_request
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
                 speculation: str = "adaptive") -> None:
        self.spec = model.spec
        self.cache = model.new_cache(num_blocks, block_size)
        self.verifier = Verifier(model, self.cache, select(model.device, kernels), True, max_batch)
        self.runner = StepRunner(self.verifier, busy_poll)
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.max_model_len = max_model_len or model.spec.max_position
        self.prefill_tokens, self.link = prefill_tokens, link
        self.controller = Controller(speculation)      # how much each step speculates
        self.sampling_defaults = sampling_defaults or {}   # for fields a request leaves unset
        self.observer: EngineObserver = observer or NullObserver()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.fallbacks: Counter[str] = Counter()
        self.limits: Counter[str] = Counter()     # times a request waited, by limiting flag
        self._wake = asyncio.Event()
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
        batch: list[Sequence] = []
        budget = self.prefill_tokens
        while self.waiting:
            if len(self.running) + len(batch) >= self.max_batch:
                self._limited("--max-batch", f"{self.max_batch} sequences already run")
                break
            seq = self.waiting[0]
            need = self._pages_for(seq.req)
            if batch and len(seq.tokens) > budget:
                break
            if need > self.cache.blocks.num_free:
                self._limited("--num-blocks", f"{self.cache.blocks.num_free} of "
                              f"{self.cache.blocks.num_blocks} KV pages are free")
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
        firsts, feats = await self.runner.compute(
            self.verifier.prefill, [s.pages for s in batch], [list(s.tokens) for s in batch],
            [s.sampling for s in batch])
        for i, (seq, tok) in enumerate(zip(batch, firsts)):
            seq.hidden = RowBuffer(feats[i]) if feats is not None and seq.speculative else None
            seq.emit(seq.commit([tok]))
        self.observer.prefilled(batch, t0, time.time_ns())
        for seq in batch:
            if seq.finish is not None:
                self.observer.finished(seq)

    def _limited(self, flag: str, why: str) -> None:
        """A request waits for a configured limit: say so (the first time, then rarely)."""
        self.limits[flag] += 1
        if self.limits[flag] in (1, 1000) or self.limits[flag] % 100000 == 0:
            log.warning("a request waits: %s (%d times so far); %s raises the limit", why,
                        self.limits[flag], flag)

    async def _draft(self, seqs: list[Sequence]) -> tuple[Drafted, Plan]:
        """The step's trees for the sequences the controller asks (plan.rows: their rows in
        seqs), or why none. A drafter of hidden states serves the sequences it saw admitted."""
        needs = bool(self.verifier.capture_layers)
        rows = [i for i, s in enumerate(seqs)
                if s.speculative and (s.hidden is not None or not needs)
                and not self._past_draft_limit(s)]
        if not rows:
            return Drafted(None), Plan(0, [])
        if self.link is None or not self.link.ready:
            return (Drafted(None, "no_draft" if self.link is None else "disconnected"),
                    Plan(0, rows))
        self.controller.charge(bucket(len(seqs)), *self.link.take_unwaited())
        plan = self.controller.plan(self.link.info, [s.seq_id for s in seqs], rows,
                                    bucket(len(seqs)))
        if not plan.depth:
            return Drafted(None, "off_by_controller"), plan
        rows = plan.rows
        got = await self.link.propose([seqs[i] for i in rows], self.observer.draft_context(),
                                      plan.depth, plan.cost_s)
        if got.trees is not None:
            t = got.trees
            why = "wrong number of rows" if len(t) != len(rows) else validate_tree(
                t.tokens, t.parents, self.link.info.envelope.num_nodes, self.spec.vocab_size,
                t.q_ids, t.q_probs)
            if why is not None:
                log.warning("dropping an invalid proposal: %s", why)
                return Drafted(None, "invalid_proposal", got.step_id, got.stamps,
                               hidden_bytes=got.hidden_bytes), plan
        return got, plan

    async def _step(self) -> None:
        seqs = [s for s in self.running if s.finish is None and not s.cancelled]
        if not seqs:
            return
        t0 = time.time_ns()
        self.observer.step_started(seqs)
        drafted, plan = await self._draft(seqs)
        t1 = time.time_ns()
        trees, index = None, None
        if drafted.trees is not None and any(drafted.trees.num_valid()):   # else: plain graph
            env = self.link.info.envelope
            trees, index = cut_depth(drafted.trees.scatter(plan.rows, len(seqs)), plan.depth,
                                     budget_nodes(env, plan.depth))
            self.verifier.siblings = env.topk
        captures = self.verifier.buckets.captures
        res = await self.runner.step([s.pages for s in seqs], [s.tokens[-1] for s in seqs],
                                     trees, plan.depth if trees is not None else 0,
                                     [s.sampling for s in seqs])
        t2 = time.time_ns()
        syncing = {plan.rows[j] for j in drafted.syncing}
        asked, resting = set(plan.rows), set(plan.resting)
        why = {s.seq_id: "syncing" if i in syncing else drafted.fallback or "empty_tree"
               if i in asked else "off_by_controller" if i in resting else self._unasked(s)
               for i, s in enumerate(seqs) if s.speculative}
        done = self._commit(seqs, trees, res, why, index)
        # waited for, nothing usable came (too slow for the deadline, or broken): 0 accepted
        failed = drafted.fallback in ("deadline", "invalid_proposal")
        if drafted.fallback in (None, "off_by_controller") or failed:
            self.controller.observe(
                plan, [s.seq_id for s in seqs], [0 if failed else -1 if i in syncing
                                                 else len(res.accepted[i]) for i in plan.rows],
                bucket(len(seqs)), None if self.verifier.buckets.captures != captures or
                drafted.catch_up and trees is None else (time.time_ns() - t0) * 1e-9,
                drafted.catch_up, drafted.fresh)
        if isinstance(self.observer, NullObserver):
            return                       # telemetry off: not even a record is built
        self._observe_step(drafted, len(seqs), done, why, trees is not None, t0, t1, t2, plan)

    def _past_draft_limit(self, s: Sequence) -> bool:
        """Whether s (with a tree's worth more) is longer than the draft takes."""
        info = self.link.info if self.link is not None else None
        return bool(info and info.max_model_len
                    and len(s.tokens) > info.max_model_len - info.envelope.depth - 1)

    def _unasked(self, s: Sequence) -> str:
        """Why a speculating sequence was not asked for a tree."""
        return "draft_max_model_len" if self._past_draft_limit(s) else "no_hidden_states"

    def _commit(self, seqs: list[Sequence], trees: TreeBatch | None, res: StepResult,
                why: dict[int, str], index: np.ndarray | None
                ) -> list[tuple[Sequence, int, int, int, int]]:
        """Commit each sequence's accepted path and bonus token and stream them;
        returns (seq, drafted, depth, accepted, committed) per sequence still running.
        why: the reason a speculating sequence ran as plain decode, if it did; index:
        the draft's node index of each verified node (treespec.common.spec.tree.cut_depth)."""
        done: list[tuple[Sequence, int, int, int, int]] = []
        tok_l = trees.tokens.tolist() if trees is not None else None
        offered_l = trees.num_valid() if trees is not None else [0] * len(seqs)
        for i, s in enumerate(seqs):
            if s.cancelled:
                continue
            path, offered = res.accepted[i], offered_l[i]
            kept = s.commit([tok_l[i][j] for j in path] + [res.bonus[i]])
            s.stats.steps += 1
            s.stats.draft_tokens += offered
            s.stats.accepted_tokens += min(len(path), len(kept))
            if s.speculative and offered == 0:
                s.stats.fallback_steps += 1
                self.fallbacks[why[s.seq_id]] += 1
                n = self.fallbacks[why[s.seq_id]]
                if why[s.seq_id] != "off_by_controller" and (n in (1, 10, 100)
                                                             or n % 10000 == 0):
                    log.warning("plain decode instead of speculation (%s): %d sequence "
                                "steps so far", why[s.seq_id], n)
            s.accepted_path = path if index is None else index[i][path].tolist()
            done.append((s, offered, len(path), min(len(path), len(kept)), len(kept)))
            if res.hidden is not None and s.hidden is not None:
                s.hidden.append(res.hidden[i])
            elif res.hidden is None:
                s.hidden = None
            s.emit(kept)
        return done

    def _observe_step(self, drafted: Drafted, batch: int,
                      done: list[tuple[Sequence, int, int, int, int]], why: dict[int, str],
                      speculated: bool, t0: int, t1: int, t2: int, plan: Plan) -> None:
        """Tell the observer what the step did; done: _commit's rows."""
        self.observer.step_finished(step_record(
            drafted, plan, batch, done, why, self.link.info.envelope if speculated else None,
            (t0, t1, t2, time.time_ns())))
        for s, *_ in done:
            if s.finish is not None:
                self.observer.finished(s)
