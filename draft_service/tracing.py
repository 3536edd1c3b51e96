"""Spans of the draft service: a DraftObserver over an OpenTelemetry TracerProvider.

Each SpeculateRequest carries the W3C context of the verify step's
``treespec.draft`` span (``trace_context``), so the draft's spans join the
request's trace:

    treespec.draft.step   (SERVER)   one SpeculateRequest: updates, rollback, propose
      treespec.draft.propose         the proposer's forward (absent when every row resynced)

Attributes: ``treespec.step_id``, ``treespec.sequences``, ``treespec.seq_ids``,
``treespec.proposed_tokens`` (valid nodes per row, aligned with seq_ids),
``treespec.resync`` (ids that must resync), ``treespec.released``.
A request without a trace context starts a trace of its own.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind

from treespec.common.serving.telemetry import extract, tracer_of
from treespec.draft_service.observer import DraftStepRecord


class DraftTracer:
    def __init__(self, provider: TracerProvider) -> None:
        self._provider = provider
        self._tracer = tracer_of(provider)

    def step_finished(self, r: DraftStepRecord) -> None:
        b = r.response
        step = self._tracer.start_span(
            "treespec.draft.step", context=extract(r.request.trace_context),
            kind=SpanKind.SERVER, start_time=r.t_start,
            attributes={"treespec.step_id": b.step_id, "treespec.sequences": len(b.seq_ids),
                        "treespec.seq_ids": b.seq_ids,
                        "treespec.proposed_tokens": b.trees.num_valid(),
                        "treespec.resync": b.resync,
                        "treespec.released": len(r.request.released)})
        if r.t_propose:
            self._tracer.start_span("treespec.draft.propose",
                                    context=trace.set_span_in_context(step),
                                    start_time=r.t_propose).end(end_time=r.t_proposed)
        step.end(end_time=r.t_end)

    def close(self) -> None:
        self._provider.force_flush()
