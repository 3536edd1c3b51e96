"""What the verify engine reports as it runs: the one hook behind traces and metrics.

The engine imports neither OpenTelemetry nor prometheus-client; it calls an
``EngineObserver`` at five points and hands it plain data. ``NullObserver`` (the
default) does nothing, so an engine without telemetry pays a few no-op calls and
``time.time_ns()`` reads per step. Implementations: ``treespec.verify_service.metrics``
(prometheus) and ``treespec.verify_service.tracing`` (spans); ``combine`` fans out to
several.

Call order, all on the engine's event loop:

    submitted(seq)            engine.submit, in the caller's context: the Generate
                              handler's, whose current span is the request span
    prefilled(seqs, t0, t1)   after a prefill forward committed each one's first token
    step_started(seqs)        a decode step over these running sequences begins
    draft_context()           only when the step asks the draft: the W3C carrier
                              to send with its SpeculateRequest ({} when untraced)
    step_finished(record)     the step committed its tokens (StepRecord below)
    finished(seq)             seq.finish was just set (stop / length / cancelled),
                              before its last output is queued
    close()                   the engine stopped

Times are ``time.time_ns()`` (epoch nanoseconds, what span timestamps want).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from treespec.common.serving import fanout
from treespec.common.spec.tree import TreeEnvelope

if TYPE_CHECKING:
    from treespec.verify_service.controller import Plan
    from treespec.verify_service.drafter import Drafted
    from treespec.verify_service.sequence import Sequence


@dataclass(frozen=True)
class StepRecord:
    """One decode step. Per-sequence lists are aligned with ``seq_ids``.

    Sequences cancelled during the step committed nothing and are left out, so the
    sums over records equal what clients see in RequestStats: drafted ->
    draft_tokens, accepted -> accepted_tokens, committed -> completion_tokens (less
    the prefill token), a non-None fallback -> fallback_steps, a true planned_plain ->
    planned_plain_steps, one row -> one step.

    Example: a chain4 step over seqs [7, 9] where 7 got 4 draft tokens, accepted 2
    and 9 ran without a tree: drafted [4, 0], depth [2, 0], accepted [2, 0],
    committed [3, 1], fallback [None, "empty_tree"], planned_plain [False, False].
    """

    step_id: int                     # the Speculate step id; 0 if the draft was not asked
    batch: int                       # sequences in the target forward
    seq_ids: list[int]
    request_ids: list[str]
    drafted: list[int]               # valid draft nodes offered to the target
    depth: list[int]                 # length of the accepted root-to-node path
    accepted: list[int]              # draft tokens committed (path cut at a stop), bonus excluded
    committed: list[int]             # tokens committed: accepted + bonus, cut at a stop
    fallback: list[str | None]       # why a speculating sequence fell back to plain decode
    reason: str | None               # why the step got no proposal at all (None: it got one,
                                     # or no sequence speculates)
    envelope: TreeEnvelope | None    # the draft's envelope when a proposal was used
    t_start: int
    t_drafted: int                   # proposal in hand (== t_start when not asked)
    t_verified: int                  # target forward, accept walk and KV commit done
    t_end: int                       # tokens committed and queued to their clients
    # where the hop went, ns by part (empty when no answer came): see hop_parts
    hop_parts: dict[str, int] = field(default_factory=dict)
    hidden_bytes: int = 0            # target hidden states the request carried
    # the controller's budget (depth verified; 0: plain decode), its expected committed
    # tokens, its step time measured so far for this budget and batch (None: not yet)
    # and the plain steps it keeps between tries for what they cost (Plan.rest_floor)
    budget: int = 0
    expected: float = 0.0
    cost_s: float | None = None
    rest_floor: int = 0
    # per sequence: the controller chose plain decode for it (not a fallback)
    planned_plain: list[bool] = field(default_factory=list)
    # sequences whose tree was pre-drafted while the last step verified (lookahead), and
    # sequences that had such candidates but none for the step's outcome
    lookahead_hits: int = 0
    lookahead_misses: int = 0


PLANNED_PLAIN = "off_by_controller"     # a plain step the controller chose

HOP_PARTS = ("send", "wait", "read", "to_draft", "draft", "to_verify")


def hop_parts(t_start: int, t_drafted: int, stamps: tuple[int, int, int, int] | None
              ) -> dict[str, int]:
    """Where a hop's time went, ns by part: send (step start -> request encoded and
    handed to the carrier), wait (handed -> answer read), read (answer read -> proposal
    in hand: decoding, checks). When the draft stamped its answer, wait splits into
    to_draft (handed -> the draft read it), draft (read -> answered) and to_verify
    (answered -> read here); those legs compare the two services' clocks, so they mean
    something on one host only, and none is reported if one comes out negative (clocks
    apart). stamps: DraftLink.stamps."""
    if stamps is None:
        return {}
    sent, answered, d_read, d_sent = stamps
    parts = {"send": sent - t_start, "wait": answered - sent, "read": t_drafted - answered}
    if d_read and d_sent:
        legs = {"to_draft": d_read - sent, "draft": d_sent - d_read,
                "to_verify": answered - d_sent}
        if min(legs.values()) >= 0:
            parts.update(legs)
    return parts


@dataclass(frozen=True)
class CommittedRow:
    """What a step did for one sequence still running after it."""

    seq: Sequence
    drafted: int        # valid draft nodes offered to the target
    depth: int          # length of the accepted root-to-node path
    accepted: int       # draft tokens committed (the path cut at a stop)
    committed: int      # tokens committed: accepted + bonus, cut at a stop

    @property
    def plain(self) -> bool:
        """A speculating sequence that ran as plain decode."""
        return self.seq.speculative and self.drafted == 0


def step_record(drafted: Drafted, plan: Plan, batch: int, rows: list[CommittedRow],
                why: dict[int, str], envelope: TreeEnvelope | None,
                times: tuple[int, int, int, int]) -> StepRecord:
    """The record of a step: rows, one per sequence still running; why the reason a
    speculating one ran plain ("off_by_controller": planned, not a fallback); times
    t_start, t_drafted, t_verified, t_end."""
    t0, t1, t2, t3 = times
    reasons = [why[r.seq.seq_id] if r.plain else None for r in rows]
    return StepRecord(
        step_id=drafted.step_id, batch=batch,
        seq_ids=[r.seq.seq_id for r in rows], request_ids=[r.seq.req.request_id for r in rows],
        drafted=[r.drafted for r in rows], depth=[r.depth for r in rows],
        accepted=[r.accepted for r in rows], committed=[r.committed for r in rows],
        fallback=[None if w == PLANNED_PLAIN else w for w in reasons],
        planned_plain=[w == PLANNED_PLAIN for w in reasons],
        reason=drafted.fallback, envelope=envelope, t_start=t0, t_drafted=t1, t_verified=t2,
        t_end=t3, hop_parts=hop_parts(t0, t1, drafted.stamps) if drafted.step_id else {},
        hidden_bytes=drafted.hidden_bytes, budget=plan.depth, expected=plan.expected,
        cost_s=plan.cost_s, rest_floor=plan.rest_floor,
        lookahead_hits=drafted.lookahead_hits, lookahead_misses=drafted.lookahead_misses)


class EngineObserver:
    """The hooks; each does nothing here, so an observer overrides what it uses."""

    def submitted(self, seq: Sequence) -> None:
        pass

    def prefilled(self, seqs: list[Sequence], t_start: int, t_end: int) -> None:
        pass

    def step_started(self, seqs: list[Sequence]) -> None:
        pass

    def draft_context(self) -> dict[str, str]:
        return {}

    def step_finished(self, record: StepRecord) -> None:
        pass

    def finished(self, seq: Sequence) -> None:
        pass

    def close(self) -> None:
        pass


class NullObserver(EngineObserver):
    """Observes nothing (telemetry off)."""


def combine(observers: list[EngineObserver]) -> EngineObserver:
    """NullObserver for none, the observer itself for one, else all of them in order."""
    return fanout.combine(observers, NullObserver())
