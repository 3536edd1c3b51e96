"""Prometheus metrics of the verify service: an EngineObserver over its own registry.

vLLM's names (so its speculative-decoding dashboards work unchanged; counters
gain ``_total`` in the exposition, e.g. ``vllm:spec_decode_num_drafts_total``),
all labelled ``model_name``:

    vllm:spec_decode_num_drafts                  sequence-steps that verified a tree
    vllm:spec_decode_num_draft_tokens            valid draft nodes offered (= RequestStats.draft_tokens)
    vllm:spec_decode_num_accepted_tokens         draft tokens accepted (= accepted_tokens)
    vllm:spec_decode_num_accepted_tokens_per_pos {position}: drafts whose accepted path
                                                 reached depth position + 1 (0-based)
    vllm:prompt_tokens / vllm:generation_tokens  (generation = completion_tokens)
    vllm:request_success                         {finished_reason: stop, length, abort}
    vllm:num_requests_running / _waiting         gauges
    vllm:kv_cache_usage_perc                     gauge, used / all target KV pages
    vllm:prefix_cache_queries / _hits            prompt tokens looked up in the prefix cache
                                                 / found there (= RequestStats.cached_tokens)

treespec's own (vLLM has none of these):

    treespec:spec_decode_accepted_length         histogram of accepted tokens per draft
    treespec:spec_decode_fallback_steps          {reason}: sequence-steps run as plain decode
                                                 against the plan (= fallback_steps)
    treespec:spec_decode_planned_plain_steps     sequence-steps the controller chose to run
                                                 as plain decode (= planned_plain_steps)
    treespec:sequence_steps                      decode steps summed over sequences (= steps)
    treespec:draft_hop_seconds                   Speculate round trip (send, draft, receive)
    treespec:draft_hop_part_seconds              {part}: where the hop went (observer.hop_parts):
                                                 send, wait, read; wait = to_draft + draft
                                                 + to_verify (same host)
    treespec:verify_forward_seconds              target forward + accept walk + KV commit
    treespec:step_seconds / treespec:prefill_seconds   whole engine iterations
    treespec:kv_pages_used / treespec:kv_pages_free    gauges
    treespec:kv_pages_cached                     gauge: pages no sequence holds, kept for
                                                 the prefixes they cache (part of _free)
    treespec:spec_budget_depth                   histogram of the controller's depth per step
                                                 (0: plain decode; verify_service/controller.py)
    treespec:spec_budget_expected_tokens         gauge: its expected committed tokens, last step
    treespec:spec_budget_step_seconds            gauge: its measured time for that budget at
                                                 that batch bucket, last step (0: not yet)
    treespec:spec_rest_floor_steps               gauge: the fewest plain steps it keeps between
                                                 tries, for what a try's catch-up (new
                                                 prompts' included) costs
    treespec:draft_connected                     gauge, 1 while the Speculate stream is up
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from treespec.common.serving.metrics import LATENCY_BUCKETS, MetricsServer, PrefixCacheCounters
from treespec.verify_service.observer import EngineObserver, StepRecord
from treespec.verify_service.sequence import Sequence

if TYPE_CHECKING:
    from treespec.verify_service.engine import VerifyEngine

FINISHED = {"stop": "stop", "length": "length", "cancelled": "abort"}
_NS = 1e-9


class VerifyMetrics(EngineObserver):
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.http: MetricsServer | None = None
        self.model_name = m = model_name
        lab = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, lab, registry=r).labels(m)

        def seconds(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, lab, buckets=LATENCY_BUCKETS, registry=r).labels(m)

        self.num_drafts = counter("vllm:spec_decode_num_drafts",
                                  "Sequence-steps whose tree the target verified.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                        "Valid draft nodes offered to the target.")
        self.num_accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                    "Draft tokens accepted (bonus tokens excluded).")
        self._per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Drafts whose accepted path reached this 0-based depth.",
                                [*lab, "position"], registry=r)
        self._pos: list[Counter] = []
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("vllm:generation_tokens", "Completion tokens committed.")
        self._finished = Counter("vllm:request_success", "Requests finished, by reason.",
                                 [*lab, "finished_reason"], registry=r)
        self.accepted_length = Histogram(
            "treespec:spec_decode_accepted_length", "Accepted draft tokens per draft.", lab,
            buckets=tuple(range(17)), registry=r).labels(m)
        self._fallback = Counter("treespec:spec_decode_fallback_steps",
                                 "Sequence-steps run as plain decode while speculating.",
                                 [*lab, "reason"], registry=r)
        self.planned_plain = counter("treespec:spec_decode_planned_plain_steps",
                                     "Sequence-steps the controller chose to run as plain "
                                     "decode.")
        self.lookahead_hits = counter("treespec:lookahead_hits",
                                      "Sequence-steps whose tree the draft pre-drafted while "
                                      "the step before verified.")
        self.lookahead_misses = counter("treespec:lookahead_misses",
                                        "Sequence-steps with pre-drafted trees, none for the "
                                        "outcome (drafted when asked).")
        self.sequence_steps = counter("treespec:sequence_steps",
                                      "Decode steps summed over sequences.")
        self.hop = seconds("treespec:draft_hop_seconds", "Speculate round trip per step.")
        self._hop_part = Histogram("treespec:draft_hop_part_seconds",
                                   "The Speculate round trip by part (send, wait, read; "
                                   "wait = to_draft + draft + to_verify).", [*lab, "part"],
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.verify = seconds("treespec:verify_forward_seconds",
                              "Target forward, accept walk and KV commit per step.")
        self.step = seconds("treespec:step_seconds", "Whole decode step.")
        self.prefill = seconds("treespec:prefill_seconds", "Prefill forward per admission.")
        self.budget = Histogram("treespec:spec_budget_depth",
                                "The speculation controller's depth per step (0: plain).",
                                lab, buckets=tuple(range(17)), registry=r).labels(m)
        self._budget_s = Counter("treespec:spec_budget_seconds",
                                 "Wall time of whole steps by the controller's depth (0: "
                                 "plain): with spec_budget_depth, a budget's mean step.",
                                 [*lab, "budget"], registry=r)
        self._by_budget: dict[int, Counter] = {}
        self.expected = Gauge("treespec:spec_budget_expected_tokens",
                              "The controller's expected committed tokens, last step.", lab,
                              registry=r).labels(m)
        self.budget_cost = Gauge("treespec:spec_budget_step_seconds",
                                 "The controller's measured step time for its budget and "
                                 "batch bucket, last step (0: not yet).", lab,
                                 registry=r).labels(m)
        self.rest_floor = Gauge("treespec:spec_rest_floor_steps",
                                "The fewest plain steps the controller keeps between tries "
                                "of speculation, for what a try's catch-up (new prompts' "
                                "included) costs.", lab,
                                registry=r).labels(m)
        self.hidden_bytes = counter("treespec:draft_hidden_state_bytes",
                                    "Target hidden states sent to the draft (EAGLE-3), bytes.")
        self._gauges = {name: Gauge(name, doc, lab, registry=r).labels(m) for name, doc in (
            ("vllm:num_requests_running", "Sequences in the running batch."),
            ("vllm:num_requests_waiting", "Requests waiting for admission."),
            ("vllm:kv_cache_usage_perc", "Fraction of target KV pages in use."),
            ("treespec:kv_pages_used", "Target KV pages held by sequences."),
            ("treespec:kv_pages_free", "Target KV pages free (cached ones included)."),
            ("treespec:kv_pages_cached", "Target KV pages no sequence holds, kept for the "
             "prefixes they cache."),
            ("treespec:draft_connected", "1 while the Speculate stream is up."))}

    def watch(self, engine: VerifyEngine) -> None:
        """Gauges read the engine's state at scrape time (no per-step cost)."""
        g = self._gauges
        blocks = engine.cache.blocks
        used = (lambda: engine.kv_pages_used) if hasattr(engine, "kv_pages_used") \
            else (lambda: blocks.num_used)
        g["vllm:num_requests_running"].set_function(lambda: len(engine.running))
        g["vllm:num_requests_waiting"].set_function(lambda: len(engine.waiting))
        g["vllm:kv_cache_usage_perc"].set_function(lambda: blocks.num_used / blocks.num_blocks)
        g["treespec:kv_pages_used"].set_function(used)
        g["treespec:kv_pages_free"].set_function(lambda: blocks.num_free)
        prefix = getattr(engine.cache, "prefix", None)
        g["treespec:kv_pages_cached"].set_function(
            lambda: 0 if prefix is None else prefix.num_cached)
        if prefix is not None:
            PrefixCacheCounters(self.registry, "model_name", self.model_name,
                                lambda: (prefix.queries, prefix.hits))
        g["treespec:draft_connected"].set_function(
            lambda: float(engine.link is not None and engine.link.ready))

    # ------------------------------------------------------------ EngineObserver

    def submitted(self, seq: Sequence) -> None:
        pass

    def prefilled(self, seqs: list[Sequence], t_start: int, t_end: int) -> None:
        self.prefill.observe((t_end - t_start) * _NS)
        self.prompt_tokens.inc(sum(len(s.req.prompt_ids) for s in seqs))
        self.generation_tokens.inc(len(seqs))

    def step_finished(self, r: StepRecord) -> None:
        if r.step_id:
            self.hop.observe((r.t_drafted - r.t_start) * _NS)
            self.hidden_bytes.inc(r.hidden_bytes)
            for part, ns in r.hop_parts.items():
                self._hop_part.labels(self.model_name, part).observe(ns * _NS)
        self.verify.observe((r.t_verified - r.t_drafted) * _NS)
        self.step.observe((r.t_end - r.t_start) * _NS)
        self.budget.observe(r.budget)
        if r.budget not in self._by_budget:
            self._by_budget[r.budget] = self._budget_s.labels(self.model_name, str(r.budget))
        self._by_budget[r.budget].inc((r.t_end - r.t_start) * _NS)
        self.expected.set(r.expected)
        self.budget_cost.set(r.cost_s or 0.0)
        self.rest_floor.set(r.rest_floor)
        self.sequence_steps.inc(len(r.seq_ids))
        self.generation_tokens.inc(sum(r.committed))
        for fallback, n in Tally(r.fallback).items():      # one labels() per reason, not
            if fallback is not None:                        # per sequence (64 at b64)
                self._fallback.labels(self.model_name, fallback).inc(n)
        self.planned_plain.inc(sum(r.planned_plain))
        if r.lookahead_hits or r.lookahead_misses:
            self.lookahead_hits.inc(r.lookahead_hits)
            self.lookahead_misses.inc(r.lookahead_misses)
        got = [a for d, a in zip(r.drafted, r.accepted) if d]   # each sum once a step
        if got:
            self.num_drafts.inc(len(got))
            self.num_draft_tokens.inc(sum(r.drafted))
            self.num_accepted.inc(sum(got))
            for a in got:
                self.accepted_length.observe(a)
            for p in range(max(got)):
                self._position(p).inc(sum(a > p for a in got))
        if r.envelope is not None and len(self._pos) < r.envelope.depth:
            self._position(r.envelope.depth - 1)   # show every position from the start

    def _position(self, p: int) -> Counter:
        while len(self._pos) <= p:
            self._pos.append(self._per_pos.labels(self.model_name, str(len(self._pos))))
        return self._pos[p]

    def finished(self, seq: Sequence) -> None:
        self._finished.labels(self.model_name, FINISHED.get(seq.finish or "", "abort")).inc()

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0 = a free port) until close(); the bound port."""
        self.http = MetricsServer(self.registry, host, port)
        return self.http.port
