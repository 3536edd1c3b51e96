"""The front's own /metrics (Prometheus text, on its HTTP port, no key needed).

    treespec:openai_requests_total{route, status}      finished HTTP requests
    treespec:openai_requests_running                    requests being answered
    treespec:openai_time_to_first_token_seconds{route}  streamed: request in -> first text

What the engine does (tokens, speculation, KV pages) is the verify's /metrics
(``treespec verify --metrics-port``). The registry is this app's own, never the
process-global one.
"""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from treespec.common.serving.metrics import LATENCY_BUCKETS

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models")


class FrontMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("treespec:openai_requests", "Finished HTTP requests.",
                                ["route", "status"], registry=r)
        self.running = Gauge("treespec:openai_requests_running",
                             "HTTP requests being answered.", registry=r)
        self.ttft = Histogram("treespec:openai_time_to_first_token_seconds",
                              "Streamed requests: from arrival to the first text.", ["route"],
                              buckets=LATENCY_BUCKETS, registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts each API request by route and the status it was answered with."""

    def __init__(self, app: ASGIApp, metrics: FrontMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in ROUTES:
            await self.app(scope, receive, send)
            return
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.running.inc()
        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.running.dec()
            self.metrics.requests.labels(scope["path"], str(status)).inc()
