"""A real OTLP/gRPC trace receiver for tests: what a collector would get, as plain spans."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts_pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as ts_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str         # "" for a root span
    attributes: dict


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class _Service(ts_grpc.TraceServiceServicer):
    def __init__(self, spans: list[ReceivedSpan], lock: threading.Lock) -> None:
        self.spans, self.lock = spans, lock

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        res.get("service.name", ""), s.name, s.trace_id.hex(), s.span_id.hex(),
                        s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes}))
        with self.lock:
            self.spans.extend(got)
        return ts_pb.ExportTraceServiceResponse()


class OtlpReceiver:
    """Listens on 127.0.0.1:port (free) until stopped; `spans` is everything exported."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        ts_grpc.add_TraceServiceServicer_to_server(_Service(self.spans, self._lock), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop(grace=1).wait()

    def __enter__(self) -> "OtlpReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
