"""Starting the verify service: model, engine, draft link, gRPC server."""

from __future__ import annotations

import logging

import grpc

from common.devices import pick_device, pick_dtype
from common.grpc_server import run_server, start_server
from common.model_paths import resolve_model
from common.qwen3 import Qwen3Model
from common.tokenizer import load_tokenizer
from protos.treespec.v1 import treespec_pb2_grpc as pb_grpc
from verify_service.config import VerifyConfig
from verify_service.draft_link import DraftLink
from verify_service.engine import VerifyEngine
from verify_service.servicer import GenerationServicer

SERVICE = "treespec.v1.Generation"


def build_engine(cfg: VerifyConfig) -> tuple[VerifyEngine, GenerationServicer]:
    path = resolve_model(cfg.model)
    device = pick_device(cfg.device)
    model = Qwen3Model.from_pretrained(path, dtype=pick_dtype(cfg.dtype, device), device=device)
    link = DraftLink(cfg.draft, cfg.reconnect_s, model.spec.vocab_size) if cfg.draft else None
    engine = VerifyEngine(model, cfg.num_blocks, cfg.block_size, cfg.max_batch,
                          cfg.max_model_len, cfg.prefill_tokens, cfg.step_deadline_ms / 1000,
                          link=link, kernels=cfg.kernels, step_mode=cfg.step_mode)
    return engine, GenerationServicer(engine, load_tokenizer(path), str(cfg.model))


async def start(cfg: VerifyConfig) -> tuple[grpc.aio.Server, int, VerifyEngine]:
    """Build and start everything (for tests and run()); returns the bound port."""
    engine, servicer = build_engine(cfg)
    if engine.link is not None:
        engine.link.start()
    engine.start()
    server, port = await start_server(
        cfg.host, cfg.port, lambda s: pb_grpc.add_GenerationServicer_to_server(servicer, s),
        [SERVICE])
    return server, port, engine


def run(cfg: VerifyConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    held: dict[str, VerifyEngine] = {}

    async def _start() -> tuple[grpc.aio.Server, int]:
        server, port, held["engine"] = await start(cfg)
        return server, port

    async def _stop() -> None:
        engine = held["engine"]
        await engine.drain(timeout_s=5.0)
        if engine.link is not None:
            await engine.link.close()

    run_server(_start, cfg.host, on_stop=_stop)
