"""Prometheus metrics of the draft service: a DraftObserver over its own registry.

The speculation counters with vLLM's names live on the verify service, the
authority on what was offered and accepted (a proposal that misses the step
deadline is drafted here but never offered there). The draft's own, labelled
``proposer``:

    treespec:draft_steps               SpeculateRequests answered
    treespec:draft_trees               rows that got a tree (not resynced)
    treespec:draft_proposed_tokens     valid draft nodes proposed
    treespec:draft_resyncs             rows answered with padding: state disagreed
    treespec:draft_step_seconds        one request: updates, rollback, propose
    treespec:draft_propose_seconds     the proposer's forward alone
    treespec:draft_sequences           gauge, sequences whose state is kept
    treespec:kv_pages_used / _free     gauges, the draft model's KV pages (model proposers)
    treespec:kv_pages_cached           gauge, of those free: pages kept for their prefixes
    vllm:prefix_cache_queries / _hits  tokens looked up in the draft's prefix cache / found
                                       there (the draft model; vLLM's names)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from treespec.common.serving.metrics import LATENCY_BUCKETS, MetricsServer, PrefixCacheCounters
from treespec.draft_service.observer import DraftStepRecord

if TYPE_CHECKING:
    from treespec.draft_service.engine import DraftEngine

_NS = 1e-9


class DraftMetrics:
    def __init__(self, proposer: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.http: MetricsServer | None = None
        self.proposer = proposer
        lab = ["proposer"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, lab, registry=r).labels(proposer)

        def seconds(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, lab, buckets=LATENCY_BUCKETS, registry=r).labels(proposer)

        self.steps = counter("treespec:draft_steps", "SpeculateRequests answered.")
        self.trees = counter("treespec:draft_trees", "Rows that got a tree.")
        self.proposed = counter("treespec:draft_proposed_tokens", "Valid draft nodes proposed.")
        self.resyncs = counter("treespec:draft_resyncs", "Rows answered with padding (resync).")
        self.step_s = seconds("treespec:draft_step_seconds", "One SpeculateRequest.")
        self.propose_s = seconds("treespec:draft_propose_seconds", "The proposer's forward.")
        self._gauge = lambda name, doc: Gauge(name, doc, lab, registry=r).labels(proposer)

    def watch(self, engine: DraftEngine) -> None:
        """Gauges read the engine's state at scrape time."""
        self._gauge("treespec:draft_sequences", "Sequences whose state is kept."
                    ).set_function(lambda: engine.num_sequences)
        cache = getattr(engine.proposer, "cache", None)
        blocks = getattr(cache, "blocks", None)
        if blocks is not None:
            self._gauge("treespec:kv_pages_used", "Draft KV pages in use."
                        ).set_function(lambda: blocks.num_used)
            self._gauge("treespec:kv_pages_free", "Draft KV pages free."
                        ).set_function(lambda: blocks.num_free)
        prefix = getattr(cache, "prefix", None)
        if prefix is not None:
            self._gauge("treespec:kv_pages_cached", "Draft KV pages no sequence holds, kept "
                        "for the prefixes they cache.").set_function(lambda: prefix.num_cached)
            PrefixCacheCounters(self.registry, "proposer", self.proposer,
                                lambda: (prefix.queries, prefix.hits))

    def step_finished(self, r: DraftStepRecord) -> None:
        self.steps.inc()
        rows = len(r.response.seq_ids) - len(r.response.resync)
        self.trees.inc(rows)
        self.resyncs.inc(len(r.response.resync))
        self.proposed.inc(sum(r.response.trees.num_valid()))
        self.step_s.observe((r.t_end - r.t_start) * _NS)
        if r.t_propose:
            self.propose_s.observe((r.t_proposed - r.t_propose) * _NS)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0 = a free port) until close(); the bound port."""
        self.http = MetricsServer(self.registry, host, port)
        return self.http.port

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None
