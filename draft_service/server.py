"""The draft service process: a DraftEngine behind a grpc.aio Drafter server."""

from __future__ import annotations

import grpc

from common.grpc_server import run_server, start_server
from draft_service.config import DraftConfig
from draft_service.engine import DraftEngine
from draft_service.proposer import Proposer
from draft_service.servicer import DrafterServicer
from protos.treespec.v1 import treespec_pb2 as pb
from protos.treespec.v1 import treespec_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name   # "treespec.v1.Drafter"


async def start(cfg: DraftConfig, proposer: Proposer | None = None
                ) -> tuple[grpc.aio.Server, int, DraftEngine]:
    """Build the engine (loading the draft model, if any) and start serving it.

    Returns the started server, its bound port (cfg.port 0 = a free one) and the
    engine, for in-process use; stop with ``await server.stop(grace)``.
    """
    server, port, servicer = await _start(cfg, proposer)
    return server, port, servicer.engine


async def _start(cfg: DraftConfig, proposer: Proposer | None
                 ) -> tuple[grpc.aio.Server, int, DrafterServicer]:
    servicer = DrafterServicer(DraftEngine(cfg, proposer))
    server, port = await start_server(
        cfg.host, cfg.port, lambda s: pb_grpc.add_DrafterServicer_to_server(servicer, s),
        [SERVICE_NAME])
    return server, port, servicer


def run(cfg: DraftConfig, proposer: Proposer | None = None) -> None:
    """Serve cfg until SIGINT/SIGTERM (prints ``listening on HOST:PORT`` first).

    proposer overrides the one cfg.method names (the benchmarks' instruments)."""
    servicers: list[DrafterServicer] = []

    async def start_one() -> tuple[grpc.aio.Server, int]:
        server, port, servicer = await _start(cfg, proposer)
        servicers.append(servicer)
        return server, port

    try:
        run_server(start_one, cfg.host)
    finally:
        for s in servicers:
            s.close()
