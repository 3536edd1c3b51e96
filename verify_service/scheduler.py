"""Scheduling one decode step: which running sequences speculate and how deep, their
trees from the draft (checked), and the one ``VerifyBatch`` the verifier runs.

Per step: the sequences that may speculate (not opted out, hidden states in hand when
the drafter reads them, short enough for the draft) are offered to the controller,
whose ``Plan`` says which of them the draft is asked for a tree and to what depth (0:
none). The draft's trees are checked (a broken draft costs speculation, never a token),
cut to the plan's budget and scattered into the batch's rows; every speculating sequence
that gets no tree has a reason (``ScheduledStep.fallback``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from treespec.common.runtime.graph_buckets import bucket
from treespec.common.spec.sampling_batch import SamplingBatch
from treespec.common.spec.tree import budget_nodes, cut_depth, validate_tree
from treespec.verify_service.controller import Controller, Plan
from treespec.verify_service.drafter import Drafted, Drafter
from treespec.verify_service.observer import PLANNED_PLAIN, EngineObserver
from treespec.verify_service.sequence import Sequence
from treespec.verify_service.verifier import Verifier, VerifyBatch

log = logging.getLogger("treespec.verify.scheduler")


@dataclass
class ScheduledStep:
    """A step as scheduled: its sequences (row i of ``batch`` is seqs[i]), the
    controller's plan, the draft's answer and what the verifier runs."""

    seqs: list[Sequence]
    plan: Plan
    drafted: Drafted
    batch: VerifyBatch
    index: np.ndarray | None     # each verified node's index in the draft's tree (None: same)
    fallback: dict[int, str]     # seq_id -> why a speculating sequence runs plain
    t_start: int                 # time.time_ns() at the step's start
    t_drafted: int               # ... once the proposal (or its absence) was in hand

    @property
    def bucket(self) -> int:
        return bucket(len(self.seqs))


class StepScheduler:
    def __init__(self, verifier: Verifier, controller: Controller, link: Drafter | None,
                 vocab_size: int) -> None:
        self.verifier, self.controller, self.link = verifier, controller, link
        self.vocab_size = vocab_size

    async def schedule(self, seqs: list[Sequence], observer: EngineObserver) -> ScheduledStep:
        t0 = time.time_ns()
        drafted, plan = await self._draft(seqs, observer)
        t1 = time.time_ns()
        trees, index, siblings = None, None, 1
        if drafted.trees is not None and any(drafted.trees.num_valid()):   # else: plain graph
            env = self.link.info.envelope
            rows = plan.rows if drafted.rows is None else [plan.rows[j] for j in drafted.rows]
            trees, index = cut_depth(drafted.trees.scatter(rows, len(seqs)), plan.depth,
                                     budget_nodes(env, plan.depth))
            siblings = env.topk
        batch = VerifyBatch([s.pages for s in seqs], [s.tokens[-1] for s in seqs], trees,
                            plan.depth if trees is not None else 0,
                            SamplingBatch([s.sampling for s in seqs]), siblings)
        return ScheduledStep(seqs, plan, drafted, batch, index,
                             self._fallbacks(seqs, plan, drafted), t0, t1)

    async def _draft(self, seqs: list[Sequence], observer: EngineObserver
                     ) -> tuple[Drafted, Plan]:
        """The step's trees for the sequences the controller asks (plan.rows: their rows in
        seqs), or why none."""
        needs_hidden = bool(self.verifier.capture_layers)
        rows = [i for i, s in enumerate(seqs)
                if s.speculative and (s.hidden is not None or not needs_hidden)
                and not self.past_draft_limit(s)]
        if not rows:
            return Drafted(None), Plan(0, [])
        if self.link is None or not self.link.ready:
            return (Drafted(None, "no_draft" if self.link is None else "disconnected"),
                    Plan(0, rows))
        b = bucket(len(seqs))
        self.controller.charge(b, *self.link.take_unwaited())
        plan = self.controller.plan(self.link.info, [s.seq_id for s in seqs], rows, b)
        if not plan.depth:
            return Drafted(None, PLANNED_PLAIN), plan
        try:
            got = await self.link.propose([seqs[i] for i in plan.rows],
                                          observer.draft_context(), plan.depth, plan.cost_s)
        except Exception:           # the draft's part failed: this step runs plain
            log.exception("asking the draft failed; the step runs as plain decode")
            return Drafted(None, "draft_error"), plan
        return self._checked(got, len(plan.rows)), plan

    def _checked(self, got: Drafted, asked: int) -> Drafted:
        """got, or no trees when they are not a valid answer for the rows asked."""
        if got.trees is None:
            return got
        t = got.trees
        rows = asked if got.rows is None else len(got.rows)
        why = "wrong number of rows" if len(t) != rows else validate_tree(
            t.tokens, t.parents, self.link.info.envelope.num_nodes, self.vocab_size,
            t.q_ids, t.q_probs)
        if why is None:
            return got
        log.warning("dropping an invalid proposal: %s", why)
        return Drafted(None, "invalid_proposal", step_id=got.step_id, stamps=got.stamps,
                       hidden_bytes=got.hidden_bytes)

    def _fallbacks(self, seqs: list[Sequence], plan: Plan, drafted: Drafted
                   ) -> dict[int, str]:
        """Why each speculating sequence would run plain if its row has no tree."""
        syncing = {plan.rows[j] for j in drafted.syncing}
        asked, resting = set(plan.rows), set(plan.resting)
        out = {}
        for i, s in enumerate(seqs):
            if not s.speculative:
                continue
            if i in syncing:
                out[s.seq_id] = "syncing"
            elif i in asked:
                out[s.seq_id] = drafted.fallback or "empty_tree"
            elif i in resting:
                out[s.seq_id] = PLANNED_PLAIN
            elif self.past_draft_limit(s):
                out[s.seq_id] = "draft_max_model_len"
            else:
                out[s.seq_id] = "no_hidden_states"
        return out

    def past_draft_limit(self, s: Sequence) -> bool:
        """Whether s (with a tree's worth more) is longer than the draft takes."""
        info = self.link.info if self.link is not None else None
        return bool(info and info.max_model_len
                    and len(s.tokens) > info.max_model_len - info.envelope.depth - 1)
