"""What the draft engine reports per Speculate step: the hook behind its traces and metrics.

The engine imports neither OpenTelemetry nor prometheus-client: after each
``DraftEngine.step`` it hands a ``DraftStepRecord`` to its ``DraftObserver``
(``NullDraftObserver`` by default, a method call per step). Implementations:
``treespec.draft_service.metrics`` and ``treespec.draft_service.tracing``. Called on the engine's
worker thread, one step at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from treespec.common.serving import fanout
from treespec.common.spec.messages import SpecRequest, SpecResponse


@dataclass(frozen=True)
class DraftStepRecord:
    request: SpecRequest     # as received; trace_context names the verify step's span
    response: SpecResponse   # as answered (padding rows for resynced sequences)
    t_start: int             # time.time_ns(): step entered
    t_propose: int           # proposer.propose started (0 when every row resynced)
    t_proposed: int          # proposer.propose returned (0 likewise)
    t_end: int


class DraftObserver:
    """The hooks; each does nothing here, so an observer overrides what it uses."""

    def step_finished(self, record: DraftStepRecord) -> None:
        pass

    def close(self) -> None:
        pass


class NullDraftObserver(DraftObserver):
    """Observes nothing (telemetry off)."""


def combine(observers: list[DraftObserver]) -> DraftObserver:
    return fanout.combine(observers, NullDraftObserver())
