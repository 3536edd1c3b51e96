"""The /metrics endpoint both services serve (prometheus-client), off unless asked.

``--metrics-port`` (config ``metrics_port``): unset = no endpoint, 0 = a free
port, P = port P, bound on the service's ``--host``. The service logs
``metrics on http://HOST:PORT/metrics`` once it is up. Each server has its own
CollectorRegistry, never the process-global one, so several servers in one
process (the in-process tests) keep their counts apart.

Names: the speculation counters carry vLLM's exact names (``vllm:`` prefix, so
a vLLM speculative-decoding dashboard works unchanged); what vLLM has no metric
for is ``treespec:``. See README "Metrics".
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily

from treespec.common.serving.bind import BindError, check_bindable

log = logging.getLogger("treespec.metrics")

# Seconds; a step on an H200 is ~5-40 ms, a CPU test step ~1-100 ms.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256,
                   0.512, 1.0, 2.5, 5.0, 10.0)


class MetricsServer:
    """prometheus-client's HTTP exposition of one registry, in a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        """BindError (naming --metrics-port) when host:port cannot be bound; the port is
        never shared (http.server sets SO_REUSEADDR only)."""
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            check_bindable(host, port, "--metrics-port")
            raise BindError(f"--metrics-port {port}: cannot bind {host}:{port} "
                            f"({e.strerror or e})") from None
        self.host = host
        self.port: int = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class PrefixCacheCounters:
    """vLLM's prefix-cache counters, in tokens, read from a PrefixCache at scrape time
    (``vllm:prefix_cache_queries_total``: prompt tokens looked up;
    ``vllm:prefix_cache_hits_total``: of those, tokens whose KV was found)."""

    def __init__(self, registry: CollectorRegistry, label: str, value: str,
                 read: Callable[[], tuple[int, int]]) -> None:
        self._label, self._value, self._read = label, value, read
        registry.register(self)

    def collect(self):
        queries, hits = self._read()
        for name, doc, v in (("vllm:prefix_cache_queries", "Prompt tokens looked up in the "
                              "prefix cache.", queries),
                             ("vllm:prefix_cache_hits", "Prompt tokens whose KV the prefix "
                              "cache held.", hits)):
            family = CounterMetricFamily(name, doc, labels=[self._label])
            family.add_metric([self._value], v)
            yield family
