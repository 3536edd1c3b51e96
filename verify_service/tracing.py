"""Spans of the verify engine: an EngineObserver over an OpenTelemetry TracerProvider.

One trace per Generate request. The request span is the Generate call's SERVER
span (treespec.common.serving.telemetry.TracingInterceptor), current when the engine hears of the
request; without one (an engine used directly) this observer opens its own.
Under it, per iteration that touched the request:

    treespec.prefill                     the prompt forward of an admission batch
    treespec.step                        one decode step, attributes below
      treespec.draft     (CLIENT)        the Speculate round trip, when the draft was asked;
        treespec.draft.step  (draft)     its W3C context travels in the SpeculateRequest,
          treespec.draft.propose         so the draft service's spans hang here
      treespec.verify                    target forward over [root, nodes], accept walk, KV commit
      treespec.accept                    committing the accepted paths + bonus tokens

A step (or prefill) serves a whole batch, so its span is a child of the oldest
request in it and links to the others' request spans. Step attributes, per
sequence aligned with ``treespec.seq_ids``: ``treespec.drafted_tokens``,
``treespec.accepted_tokens``, ``treespec.accepted_depth``,
``treespec.committed_tokens``, ``treespec.fallback`` ("" when it speculated);
per step: ``treespec.sequences``, ``treespec.step_id``, ``treespec.envelope``
(+ ``.depth``, ``.topk``, ``.num_nodes``), ``treespec.fallback_reason``, and the
speculation controller's ``treespec.budget.depth`` (0: plain decode),
``treespec.budget.expected_tokens``, ``treespec.budget.step_seconds`` (its
measured time for that budget at this batch size; absent until measured) and
``treespec.budget.rest_floor`` (the fewest plain steps between tries).
The request span gets its final RequestStats as ``treespec.stats.*``.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Link, Span, SpanKind

from treespec.common.serving.telemetry import inject, tracer_of
from treespec.verify_service.observer import EngineObserver, StepRecord
from treespec.verify_service.sequence import Sequence


class VerifyTracer(EngineObserver):
    def __init__(self, provider: TracerProvider) -> None:
        self._provider = provider
        self._tracer = tracer_of(provider)
        self._requests: dict[int, tuple[Span, bool]] = {}   # seq_id -> (span, opened here)
        self._step: Span | None = None
        self._draft: Span | None = None

    def submitted(self, seq: Sequence) -> None:
        span = trace.get_current_span()
        owned = not span.get_span_context().is_valid
        if owned:
            span = self._tracer.start_span("treespec.request", context=Context())
        span.set_attributes({"treespec.seq_id": seq.seq_id,
                             "treespec.request_id": seq.req.request_id,
                             "treespec.prompt_tokens": len(seq.req.prompt_ids),
                             "treespec.max_tokens": seq.req.max_tokens,
                             "treespec.speculative": seq.speculative})
        self._requests[seq.seq_id] = (span, owned)

    def _parent(self, seqs: list[Sequence]) -> tuple[Context, list[Link]]:
        spans = [self._requests[s.seq_id][0] for s in seqs if s.seq_id in self._requests]
        if not spans:
            return Context(), []
        return (trace.set_span_in_context(spans[0], Context()),
                [Link(s.get_span_context()) for s in spans[1:]])

    def prefilled(self, seqs: list[Sequence], t_start: int, t_end: int) -> None:
        ctx, links = self._parent(seqs)
        span = self._tracer.start_span(
            "treespec.prefill", context=ctx, links=links, start_time=t_start,
            attributes={"treespec.sequences": len(seqs),
                        "treespec.seq_ids": [s.seq_id for s in seqs],
                        "treespec.prompt_tokens": [len(s.req.prompt_ids) for s in seqs]})
        span.end(end_time=t_end)

    def step_started(self, seqs: list[Sequence]) -> None:
        ctx, links = self._parent(seqs)
        self._step = self._tracer.start_span("treespec.step", context=ctx, links=links)
        self._draft = None

    def draft_context(self) -> dict[str, str]:
        if self._step is None:
            return {}
        self._draft = self._tracer.start_span(
            "treespec.draft", context=trace.set_span_in_context(self._step, Context()),
            kind=SpanKind.CLIENT, attributes={"rpc.system": "grpc",
                                              "rpc.service": "treespec.v1.Drafter",
                                              "rpc.method": "Speculate"})
        return inject(self._draft)

    def step_finished(self, r: StepRecord) -> None:
        step, draft = self._step, self._draft
        self._step = self._draft = None
        if step is None:
            return
        ctx = trace.set_span_in_context(step, Context())
        if draft is not None:
            draft.set_attribute("treespec.step_id", r.step_id)
            if r.reason:
                draft.set_attribute("treespec.fallback_reason", r.reason)
            draft.set_attributes({"treespec.lookahead.hits": r.lookahead_hits,
                                  "treespec.lookahead.misses": r.lookahead_misses})
            draft.end(end_time=r.t_drafted)
        per_seq = {"treespec.seq_ids": r.seq_ids,
                   "treespec.accepted_depth": r.depth,
                   "treespec.accepted_tokens": r.accepted,
                   "treespec.committed_tokens": r.committed}
        self._tracer.start_span("treespec.verify", context=ctx, start_time=r.t_drafted,
                                attributes={"treespec.sequences": r.batch}
                                ).end(end_time=r.t_verified)
        self._tracer.start_span("treespec.accept", context=ctx, start_time=r.t_verified,
                                attributes=per_seq).end(end_time=r.t_end)
        attrs = {**per_seq, "treespec.sequences": r.batch, "treespec.step_id": r.step_id,
                 "treespec.request_ids": r.request_ids,
                 "treespec.drafted_tokens": r.drafted,
                 "treespec.fallback": [f or "" for f in r.fallback],
                 "treespec.budget.depth": r.budget,
                 "treespec.budget.expected_tokens": r.expected,
                 "treespec.budget.rest_floor": r.rest_floor,
                 "treespec.lookahead.hits": r.lookahead_hits,
                 "treespec.lookahead.misses": r.lookahead_misses}
        if r.cost_s is not None:
            attrs["treespec.budget.step_seconds"] = r.cost_s
        if r.envelope is not None:
            e = r.envelope
            attrs.update({"treespec.envelope": e.name, "treespec.envelope.depth": e.depth,
                          "treespec.envelope.topk": e.topk,
                          "treespec.envelope.num_nodes": e.num_nodes})
        if r.reason:
            attrs["treespec.fallback_reason"] = r.reason
        step.set_attributes(attrs)
        step.end(end_time=r.t_end)

    def finished(self, seq: Sequence) -> None:
        got = self._requests.pop(seq.seq_id, None)
        if got is None:
            return
        span, owned = got
        if span.is_recording():
            span.set_attributes({"treespec.finish_reason": seq.finish or "",
                                 **{f"treespec.stats.{k}": v for k, v in vars(seq.stats).items()}})
        if owned:
            span.end()

    def close(self) -> None:
        for span, owned in self._requests.values():
            if owned:
                span.end()
        self._requests.clear()
        self._provider.force_flush()
