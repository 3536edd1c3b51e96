"""How much to speculate: a budget chosen each step from measured cost and acceptance.

Each step the engine asks ``Controller.plan`` for a *budget*: 0 (plain decode, the
draft not asked) or a depth d from ``budget_depths(envelope)`` (the envelope's depth
and its halvings). The draft is told d; its trees are cut to depth d
(treespec.common.spec.tree.cut_depth) and verified by the step graph of that width. The budget
maximises expected committed tokens per second of the batch::

    score(d) = (B + sum_i E_i[min(L_i, d)]) / cost(d, b)

over the B sequences, the sum over those asked for a tree. E_i[min(L_i, d)] =
sum_{k <= d} prod_{j <= k} c_ij, where c_ij is the rate at which sequence i's drafts
were accepted at depth j when depth j - 1 was (decayed counts; a step verified to
depth d says nothing past d, so an unused depth drifts back to the prior, or to the
rate of the depth above where that is higher, and is tried again), shrunk toward the
batch's rates while a sequence has few steps.
cost(d, b) is the measured wall time of whole steps (draft, hop, verify, commit)
at batch bucket b, a running average per (d, b) from the lower of its first two steps
on (a first step can be slow for reasons of its own, and a shape costed dear on one
step is never chosen to be measured again) that leaves out steps that captured
a graph or where the draft caught up with a sequence (new, or back from a rest); a
shape not measured at b borrows its ratio to plain decode from the nearest bucket
that has both (1.05, optimistic, when none has), and plain decode is measured at a
bucket after a few speculating steps there.

A sequence whose expected gain falls under ``REST_BELOW`` tokens rests (runs plain
inside a speculating batch, not asked) and is retried after 8, 16, ... 256 steps;
when plain decode wins for the batch, speculation is retried after 16, 32, ... 256
plain steps. A try costs more than its deeper verify: the draft catches up on what it
missed while the sequence rested (waited for: the step's time over that budget's
measured step; or sent without waiting: the draft's time on it, paid for by the steps
beside it where the draft shares the GPU). That extra (a running average per bucket)
sets a floor on both rests: long enough that tries cost at most ``RETRY_SHARE`` of the
plain steps between them. A retry of the batch also brings the draft every prompt that
came since (a 1024-token prompt costs a 0.6B draft tens of plain steps' time): what
taking in new prompts adds (its own average) raises that rest's floor too. A new draft
handshake starts it over. Modes: adaptive (this), always (every sequence, the whole
envelope, every step), off (the draft is never asked). A budget changes speed, never
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from treespec.common.runtime.graph_buckets import BATCH_BUCKETS
from treespec.common.spec.messages import DrafterInfo
from treespec.common.spec.tree import TreeEnvelope, budget_depths, budget_nodes

MODES = ("adaptive", "always", "off")
REST_BELOW = 0.15          # expected accepted tokens a step under which a sequence rests
BATCH_DECAY, SEQ_DECAY = 0.95, 0.95      # per step
PRIOR_RATE, PRIOR_WEIGHT, SEQ_WEIGHT = 0.5, 1.0, 1.0
UNKNOWN_RATIO = 1.05       # a shape's cost over plain decode's before it is measured
MAX_RETRY = 256            # the longest rest the doubling reaches
RETRY_SHARE = 0.01         # what tries (their catch-ups) may cost of the plain steps between
                           # (a third of the 3 % that "never slower than plain" leaves)
MAX_REST = 4096            # the longest rest the catch-ups' cost sets
PLAIN_AFTER = 4            # speculating steps at a bucket before plain decode is measured
SETTLE_DRIFT = 1.05        # how far plain's measured step may rise before a batch plain won
                           # for is weighed again (the one input that moves while it runs)
MAX_STEPS = 1 << 62


class Counts:
    """Decayed counts of drafts tried and accepted at each depth (column j - 1), one
    row per sequence (a slot, handed to another once its sequence ends), or one row
    for the batch."""

    def __init__(self, depth: int, decay: float) -> None:
        self.decay = decay
        self.tried, self.hit = np.zeros((8, depth)), np.zeros((8, depth))
        self.rest_until = np.zeros(8, dtype=np.int64)   # the step it is asked again from
        self.backoff = np.full(8, 8, dtype=np.int64)    # its next rest's length
        self._slot: dict[int, int] = {}
        self._j = np.arange(1, depth + 1)

    def slots(self, ids: list[int]) -> np.ndarray:
        for i in ids:
            if i not in self._slot:
                if len(self._slot) == len(self.tried):      # full: twice the room
                    self.tried, self.hit, self.rest_until, self.backoff = (
                        np.concatenate([x, np.zeros_like(x) + fill]) for x, fill in (
                            (self.tried, 0), (self.hit, 0), (self.rest_until, 0),
                            (self.backoff, 8)))
                self._slot[i] = len(self._slot)
        return np.array([self._slot[i] for i in ids], dtype=np.int64)

    def forget(self, seq_id: int) -> None:
        """Its slot goes to the sequence in the last slot, whose slot is cleared."""
        slot = self._slot.pop(seq_id, None)
        if slot is None:
            return
        last = len(self._slot)
        if slot != last:
            self._slot[next(k for k, v in self._slot.items() if v == last)] = slot
            for x in (self.tried, self.hit, self.rest_until, self.backoff):
                x[slot] = x[last]
        self.tried[last], self.hit[last] = 0, 0
        self.rest_until[last], self.backoff[last] = 0, 8

    def add(self, slots: np.ndarray, budget: int, accepted: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
        """Fade these rows, then count a draft each verified to depth `budget` whose
        accepted path was `accepted` long (depths 1 .. min(budget, a + 1) tried, 1 ..
        min(budget, a) hit); returns what was added (tried, hit), [len(slots), depth]."""
        a = accepted[:, None]
        tried = (self._j <= np.minimum(budget, a + 1)).astype(float)
        hit = (self._j <= np.minimum(budget, a)).astype(float)
        self.tried[slots] = self.tried[slots] * self.decay + tried
        self.hit[slots] = self.hit[slots] * self.decay + hit
        return tried, hit

    def rates(self, slots: np.ndarray, prior: np.ndarray, weight: float) -> np.ndarray:
        """Each depth's rate shrunk toward the prior or, where higher, toward the rate
        of the depth above: a depth the budgets have not reached lately is expected to
        do as well as the one above it (else a sequence whose first drafts failed and
        then accepted every one at depth 1 is never tried deeper)."""
        hit, tried = self.hit[slots], self.tried[slots]
        out = np.empty_like(hit)
        above = np.zeros(len(slots))
        for j in range(hit.shape[1]):
            toward = np.maximum(prior[..., j], above)
            out[:, j] = above = (hit[:, j] + weight * toward) / (tried[:, j] + weight)
        return out


def expected(rates: np.ndarray) -> np.ndarray:
    """E[min(L, d)] for d = 0 .. depth (columns) from conditional acceptance rates
    [n, depth], a row per sequence."""
    out = np.zeros((rates.shape[0], rates.shape[1] + 1))
    out[:, 1:] = np.cumsum(np.cumprod(rates, 1), 1)
    return out


@dataclass
class Plan:
    depth: int                          # 0: plain decode, the draft not asked
    rows: list[int]                     # the candidates asked for a tree
    resting: list[int] = field(default_factory=list)   # candidates left plain
    expected: float = 0.0               # expected committed tokens of the step
    cost_s: float | None = None         # its measured wall time (None: not yet known)
    forced: bool = False                # a retry of speculation after plain steps
    rest_floor: int = 0                 # plain steps the tries' measured cost asks between


class Controller:
    def __init__(self, mode: str = "adaptive") -> None:
        if mode not in MODES:
            raise ValueError(f"speculation must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._info: DrafterInfo | None = None
        self.env: TreeEnvelope | None = None
        self.batch = self.seqs = None       # Counts: of the batch (one row), per sequence
        self._cost: dict[tuple[int, int], float] = {}
        self._first: dict[tuple[int, int], float] = {}     # a shape's one step so far
        self._catch_up: dict[int, float] = {}       # per bucket: what a catch-up adds, s
        self._fresh: dict[int, float] = {}          # ... taking in new prompts, s
        self._spec_steps: dict[int, int] = {}       # speculating steps measured per bucket
        self.steps = 0
        self._plain_run, self._retry = 0, 16
        # a batch (bucket, its rows' ids) for which plain decode won: it stands, without
        # weighing again, until a speculating step, a retry, a resting row's turn or a
        # rise in plain decode's measured cost
        self._settled: tuple | None = None
        self._settled_until, self._settled_cost = 0, 0.0

    def _draft(self, info: DrafterInfo) -> None:
        if info is not self._info:      # a new handshake (another draft, perhaps): start over
            self._info, self.env = info, info.envelope
            self.batch = Counts(self.env.depth, BATCH_DECAY)
            self.seqs = Counts(self.env.depth, SEQ_DECAY)
            self._cost.clear()
            self._first.clear()
            self._catch_up.clear()
            self._fresh.clear()
            self._spec_steps.clear()
            self._plain_run, self._retry = 0, 16
            self._settled = None

    def plan(self, info: DrafterInfo, seq_ids: list[int], rows: list[int], b: int) -> Plan:
        """The budget for a step of len(seq_ids) sequences (batch bucket b) of which
        `rows` may speculate, with the draft of this handshake."""
        p = self._plan(info, seq_ids, rows, b)
        p.rest_floor = self._rest_floor(b, fresh=True)
        return p

    def _plan(self, info: DrafterInfo, seq_ids: list[int], rows: list[int], b: int) -> Plan:
        if self.mode == "off" or not rows:
            return Plan(0, [], list(rows))
        self._draft(info)
        env = self.env
        if self.mode == "always":
            return Plan(env.depth, list(rows))
        forced = self._plain_run >= self._retry         # a retry: every row is asked
        ids = tuple(seq_ids[r] for r in rows)
        n = len(seq_ids)
        plain = Plan(0, [], list(rows), float(n), self._cost.get((0, b)))
        if (not forced and self._settled == (b, ids) and self.steps < self._settled_until
                and self._cost.get((0, b), 0.0) <= self._settled_cost * SETTLE_DRIFT):
            return plain                # nothing changed since plain won
        slots = self.seqs.slots(ids)
        due = np.ones(len(rows), bool) if forced else self.seqs.rest_until[slots] <= self.steps
        ask = [r for r, m in zip(rows, due) if m]
        resting = [r for r, m in zip(rows, due) if not m]
        if not ask:                     # every row rests
            return self._settle(plain, b, ids, slots, due)
        gain = expected(self.seqs.rates(slots[due], self._prior(), SEQ_WEIGHT)).sum(0)
        spec = max((Plan(d, ask, resting, n + gain[d], self._cost.get((d, b)), forced)
                    for d in budget_depths(env)), key=lambda p: p.expected / self._ratio(p.depth, b))
        if forced:
            return spec
        if spec.expected / self._ratio(spec.depth, b) <= n:
            return self._settle(plain, b, ids, slots, due)      # plain wins
        if self._spec_steps.get(b, 0) >= PLAIN_AFTER and (0, b) not in self._cost:
            return plain                # plain is not yet measured here
        return spec

    def _settle(self, plain: Plan, b: int, ids: tuple, slots: np.ndarray, due: np.ndarray
                ) -> Plan:
        """Plain won for this batch: so it stays until a resting row's turn comes, or
        plain decode's measured step rises past SETTLE_DRIFT of what it is now."""
        self._settled, self._settled_cost = (b, ids), self._cost.get((0, b), 0.0)
        self._settled_until = int(self.seqs.rest_until[slots[~due]].min()) if not due.all() \
            else MAX_STEPS
        return plain

    def shapes(self, env: TreeEnvelope) -> list[tuple[int, int]]:
        """(tree width, depth) of each budget this controller may choose."""
        if self.mode == "off":
            return []
        depths = budget_depths(env) if self.mode == "adaptive" else (env.depth,)
        return [(budget_nodes(env, d), d) for d in depths]

    def _ratio(self, d: int, b: int) -> float:
        """cost(d, b) / cost(0, b): measured, or borrowed from the nearest bucket that
        measured both, or UNKNOWN_RATIO (optimistic: the shape gets tried where it
        could win)."""
        if d == 0:
            return 1.0
        near = sorted((abs(BATCH_BUCKETS.index(x) - BATCH_BUCKETS.index(b))
                       if x in BATCH_BUCKETS and b in BATCH_BUCKETS else abs(x - b), x)
                      for (dd, x) in self._cost if dd == d and (0, x) in self._cost)
        if not near:
            return UNKNOWN_RATIO
        x = near[0][1]
        return self._cost[(d, x)] / self._cost[(0, x)]

    def observe(self, plan: Plan, seq_ids: list[int], accepted: list[int], b: int,
                seconds: float | None, caught_up: bool = False, fresh: bool = False
                ) -> None:
        """What the planned step did: the accepted path length of each row asked (in
        plan.rows' order; -1: no tree, still syncing), its wall time (None: it captured
        a graph) and whether the draft caught up with a sequence in it (then the wall
        time is what a try costs, not what a step of its shape does), fresh: with a
        new prompt."""
        self.steps += 1
        if self.mode != "adaptive" or self.batch is None:
            return
        got = [(r, a) for r, a in zip(plan.rows, accepted) if a >= 0]   # -1: syncing
        if plan.depth and (got or not plan.forced):     # a try all syncing: tried again
            self._plain_run, self._settled = 0, None
            self._retry = max(min(2 * self._retry, MAX_RETRY) if plan.forced else 16,
                              self._rest_floor(b, fresh=True))
            if got:
                slots = self.seqs.slots([seq_ids[r] for r, _ in got])
                tried, hit = self.seqs.add(slots, plan.depth, np.array([a for _, a in got]))
                bt = self.batch
                bt.tried[0] = bt.tried[0] * bt.decay + tried.sum(0)
                bt.hit[0] = bt.hit[0] * bt.decay + hit.sum(0)
                self._rest(slots, b)
            self._spec_steps[b] = self._spec_steps.get(b, 0) + 1
        elif plan.resting:
            self._plain_run += 1
        if seconds is not None and caught_up:     # what the catch-up added to the step
            base = self._cost.get((plan.depth, b), self._cost.get((0, b)))
            if base is not None:
                self._note(self._fresh if fresh else self._catch_up, b,
                           max(0.0, seconds - base))
        elif seconds is not None:
            key = (plan.depth, b)
            old = self._cost.get(key)
            if old is None:             # measured from its second step on
                first = self._first.pop(key, None)
                if first is None:
                    self._first[key] = seconds
                else:
                    self._cost[key] = min(first, seconds)
            else:                       # quick to fall, slow to rise past outliers
                a = 0.3 if seconds < old else 0.1
                self._cost[key] = old + a * (min(seconds, 3 * old) - old)

    def _prior(self) -> np.ndarray:
        """The batch's rates: what a sequence's own few steps are shrunk toward."""
        return self.batch.rates(np.zeros(1, np.int64), np.full(self.env.depth, PRIOR_RATE),
                                PRIOR_WEIGHT)[0]

    def _rest(self, slots: np.ndarray, b: int) -> None:
        """Rest the sequences whose expected gain fell under REST_BELOW (once they
        have tried twice), each time twice as long (and no shorter than the floor the
        catch-ups' cost sets); a gaining one's rest resets."""
        s = self.seqs
        gain = expected(s.rates(slots, self._prior(), SEQ_WEIGHT))[:, -1]
        s.backoff[slots[gain >= REST_BELOW]] = 8
        tired = slots[(gain < REST_BELOW) & (s.tried[slots, 0] >= 2)]
        s.rest_until[tired] = self.steps + np.maximum(s.backoff[tired], self._rest_floor(b))
        s.backoff[tired] = np.minimum(2 * s.backoff[tired], MAX_RETRY)

    def charge(self, b: int, seconds: float, fresh_seconds: float = 0.0) -> None:
        """Draft time no step waited for (a catch-up sent without waiting, an answer
        past the deadline) on returning sequences and on new prompts: a try's cost all
        the same, where the draft shares the GPU (counted as if it did)."""
        if self.batch is not None:
            for into, x in ((self._catch_up, seconds), (self._fresh, fresh_seconds)):
                if x > 0:
                    self._note(into, b, x)

    @staticmethod
    def _note(into: dict[int, float], b: int, extra: float) -> None:
        old = into.get(b)
        into[b] = extra if old is None else old + 0.3 * (extra - old)

    def _rest_floor(self, b: int, fresh: bool = False) -> int:
        """Plain steps between two tries so that what a try's catch-up adds is at most
        RETRY_SHARE of them (0 until measured); fresh: a retry of the batch, which
        brings the draft the new prompts too."""
        extra = self._catch_up.get(b, 0.0) + (self._fresh.get(b, 0.0) if fresh else 0.0)
        plain = self._cost.get((0, b))
        if not extra or not plain:
            return 0
        return min(MAX_REST, int(extra / (RETRY_SHARE * plain)))

    def forget(self, seq_id: int) -> None:
        if self.seqs is not None:
            self.seqs.forget(seq_id)
