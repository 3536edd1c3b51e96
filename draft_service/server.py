"""The draft service process: a DraftEngine behind a grpc.aio Drafter server."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from treespec.common.serving.grpc_server import run_server, start_server
from treespec.common.serving.telemetry import DRAFT_SERVICE_NAME, tracer_provider_from_env
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.engine import DraftEngine
from treespec.draft_service.local_server import LocalServer, peer_check_possible
from treespec.draft_service.observer import DraftObserver, combine
from treespec.draft_service.proposer import Proposer
from treespec.draft_service.servicer import DrafterServicer
from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc

log = logging.getLogger("treespec.draft")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name   # "treespec.v1.Drafter"

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider


class DraftServer:
    """The draft's gRPC server and its local-socket server (when on); stop() stops both."""

    def __init__(self, server: grpc.aio.Server, servicer: DrafterServicer,
                 local: LocalServer | None) -> None:
        self.grpc, self.servicer, self.local = server, servicer, local

    async def stop(self, grace: float | None) -> None:
        if self.local is not None:
            await self.local.close()
        await self.grpc.stop(grace)


def build_engine(cfg: DraftConfig, proposer: Proposer | None,
                 tracer_provider: TracerProvider | None) -> DraftEngine:
    """The engine with its observer: metrics when cfg.metrics_port is set, spans when traced."""
    if tracer_provider is None:
        tracer_provider = tracer_provider_from_env(DRAFT_SERVICE_NAME)
    engine = DraftEngine(cfg, proposer)
    observers: list[DraftObserver] = []
    if cfg.metrics_port is not None:
        from treespec.draft_service.metrics import DraftMetrics
        metrics = DraftMetrics(cfg.method)
        metrics.watch(engine)
        metrics.serve(cfg.host, cfg.metrics_port)
        observers.append(metrics)
    if tracer_provider is not None:
        from treespec.draft_service.tracing import DraftTracer
        observers.append(DraftTracer(tracer_provider))
    engine.observer = combine(observers)
    return engine


async def start(cfg: DraftConfig, proposer: Proposer | None = None,
                tracer_provider: TracerProvider | None = None
                ) -> tuple[DraftServer, int, DraftEngine]:
    """Build the engine (loading the draft model, if any) and start serving it.

    Returns the started servers, the gRPC port (cfg.port 0 = a free one) and the
    engine, for in-process use; stop with ``await server.stop(grace)``, then
    ``engine.observer.close()`` (closes /metrics). Traces go to tracer_provider,
    by default the one the OTEL_* variables describe (none when tracing is off).
    """
    servicer = DrafterServicer(build_engine(cfg, proposer, tracer_provider))
    address = cfg.local_address(servicer.instance_id)
    if address is not None and not peer_check_possible():
        log.info("no local socket: this platform cannot tell who connects to it")
        address = None
    local = None
    if address is not None:     # before the gRPC server: GetInfo may advertise it at once
        local = LocalServer(servicer, address, cfg.local_socket_uids)
        try:
            await local.start()
        except OSError as e:
            log.warning("no local socket at %s (%s): steps travel by gRPC only", address, e)
            local = None
        else:
            servicer.local_socket = address
    server, port = await start_server(
        cfg.host, cfg.port, lambda s: pb_grpc.add_DrafterServicer_to_server(servicer, s),
        [SERVICE_NAME], tls=cfg.server_tls, api_keys=cfg.api_keys,
        reflect=cfg.reflect)
    return DraftServer(server, servicer, local), port, servicer.engine


def run(cfg: DraftConfig, proposer: Proposer | None = None) -> None:
    """Serve cfg until SIGINT/SIGTERM (prints ``listening on HOST:PORT`` first).

    proposer overrides the one cfg.method names (the benchmarks' instruments)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    held: list[DraftServer] = []

    async def start_one() -> tuple[grpc.aio.Server, int]:
        server, port, _ = await start(cfg, proposer)
        held.append(server)
        return server.grpc, port

    async def on_stop() -> None:
        for s in held:
            if s.local is not None:
                await s.local.close()

    try:
        run_server(start_one, cfg.host, on_stop)
    finally:
        for s in held:
            s.servicer.close()
            s.servicer.engine.observer.close()
