"""Tracing setup for both services: OpenTelemetry from the standard OTEL_* variables.

Tracing is OFF unless the environment asks for it, so an unconfigured service
never imports the SDK's exporters nor creates a span:

    OTEL_SDK_DISABLED=true                    -> off, whatever else is set
    OTEL_TRACES_EXPORTER=none                 -> off
    OTEL_TRACES_EXPORTER=otlp | console       -> on (otlp: OTLP over gRPC)
    OTEL_EXPORTER_OTLP_ENDPOINT or
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set    -> on, OTLP over gRPC
    none of these                             -> off

(The OpenTelemetry default for OTEL_TRACES_EXPORTER is "otlp"; treespec treats an
unset exporter with no endpoint as off, so a bare `treespec verify` sends nothing
anywhere.) Everything else is the SDK's: OTEL_SERVICE_NAME (default here
"treespec-verify" / "treespec-draft"), OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_*,
OTEL_EXPORTER_OTLP_* (endpoint, headers, insecure, timeout), OTEL_PROPAGATORS.

Each server gets its own TracerProvider (never the global one), so two services
in one process (the in-process tests) keep their service names apart. The
Speculate hop carries the W3C context per message (``SpeculateRequest.trace_context``);
Generate calls may carry it as gRPC metadata (``traceparent``), which
``TracingInterceptor`` continues.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

SCOPE = "treespec"
VERIFY_SERVICE_NAME = "treespec-verify"
DRAFT_SERVICE_NAME = "treespec-draft"
GENERATE_METHOD = "/treespec.v1.Generation/Generate"


def tracing_configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the OTEL_* variables ask for traces (see the module docstring)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",")
                 if e.strip()}
    if exporters:
        return exporters != {"none"}
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def tracer_provider_from_env(default_service_name: str,
                             environ: Mapping[str, str] = os.environ) -> TracerProvider | None:
    """A TracerProvider exporting as the OTEL_* variables say, or None when tracing is off.

    The provider flushes its batch processor at interpreter exit (the SDK's
    shutdown_on_exit), so a service stopped by SIGTERM still sends its last spans.
    """
    if not tracing_configured(environ):
        return None
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = new_provider(default_service_name)
    exporters = {e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")
                 if e.strip()} or {"otlp"}
    for name in sorted(exporters - {"none"}):
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter()
        elif name == "console":
            exporter = ConsoleSpanExporter()
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: treespec supports otlp, console, none")
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def new_provider(default_service_name: str) -> TracerProvider:
    """A provider with no processor yet; OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win."""
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create({SERVICE_NAME: default_service_name})
    return TracerProvider(resource=resource.merge(OTELResourceDetector().detect()))


def tracer_of(provider: TracerProvider) -> Tracer:
    return provider.get_tracer(SCOPE)


def inject(span: Span) -> dict[str, str]:
    """The W3C carrier ({"traceparent": ...}) that makes span the remote parent."""
    from opentelemetry import propagate, trace

    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def extract(carrier: Mapping[str, str]) -> Context:
    """The parent context a carrier names (an empty context when it names none)."""
    from opentelemetry import propagate

    return propagate.extract(dict(carrier))


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """One SERVER span per call of the chosen methods, current while the handler runs.

    The span continues a W3C context sent as call metadata. Installed first (outermost),
    so it sees the status the error-mapping interceptor leaves. Other methods
    (health checks, reflection, the long-lived Speculate stream) pass untouched.
    """

    def __init__(self, provider: TracerProvider, methods: Collection[str] = (GENERATE_METHOD,)
                 ) -> None:
        self._tracer = tracer_of(provider)
        self._methods = frozenset(methods)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails
                                ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method not in self._methods:
            return handler
        if handler.request_streaming or not handler.response_streaming \
                or not inspect.isasyncgenfunction(handler.unary_stream):
            return handler
        return grpc.unary_stream_rpc_method_handler(
            self._traced(handler.unary_stream, details.method),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def _traced(self, behavior: Callable, method: str) -> Callable:
        from opentelemetry.trace import SpanKind

        service, _, name = method.lstrip("/").partition("/")
        tracer = self._tracer

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            parent = extract({k: v for k, v in (context.invocation_metadata() or ())
                              if isinstance(v, str)})
            with tracer.start_as_current_span(
                    f"{service}/{name}", context=parent, kind=SpanKind.SERVER,
                    attributes={"rpc.system": "grpc", "rpc.service": service,
                                "rpc.method": name}):
                async for response in behavior(request, context):
                    yield response
        return stream
