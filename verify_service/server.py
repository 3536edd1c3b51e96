"""Starting the verify service: model, engine, draft link, gRPC server."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import grpc

from treespec.common.runtime.devices import bind_device, pick_device, pick_dtype
from treespec.kernels.availability import triton_available
from treespec.common.serving.grpc_server import run_server, start_server
from treespec.common.model.paths import resolve_model
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.spec.sampling import checkpoint_defaults
from treespec.common.serving.telemetry import VERIFY_SERVICE_NAME, TracingInterceptor, tracer_provider_from_env
from treespec.common.model.tokenizer import load_tokenizer
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc
from treespec.verify_service.config import VerifyConfig
from treespec.verify_service.draft_link import DraftLink
from treespec.verify_service.engine import VerifyEngine
from treespec.verify_service.observer import EngineObserver, combine
from treespec.verify_service.servicer import GenerationServicer

SERVICE = "treespec.v1.Generation"
# a Generate request's bytes beside its text prompt (prompt ids up to a long context,
# stop ids, ids): with --max-prompt-bytes, the largest request read at all
REQUEST_ROOM = 4 << 20
log = logging.getLogger("treespec.verify")

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from treespec.verify_service.metrics import VerifyMetrics


def build_observer(cfg: VerifyConfig, tracer_provider: TracerProvider | None
                   ) -> tuple[EngineObserver, VerifyMetrics | None]:
    """The engine's observer (metrics when cfg.metrics_port is set, spans when traced)."""
    observers: list[EngineObserver] = []
    metrics = None
    if cfg.metrics_port is not None:
        from treespec.verify_service.metrics import VerifyMetrics
        metrics = VerifyMetrics(str(cfg.model))
        observers.append(metrics)
    if tracer_provider is not None:
        from treespec.verify_service.tracing import VerifyTracer
        observers.append(VerifyTracer(tracer_provider))
    return combine(observers), metrics


def _warn_untuned(cfg: VerifyConfig, device) -> None:
    """One line when the invariant GEMM has no tuned table for this GPU (it then runs one
    16-row config per product: bit-exact, several times slower past a few rows)."""
    if cfg.target_kernels != "invariant" or not triton_available(device):
        return
    from treespec.kernels.triton_gemv import invariant_tuned        # imports triton
    if not invariant_tuned(device):
        log.warning("no tuned invariant GEMM table for %s: one 16-row config per product "
                    "(bit-exact, slow past a few rows); tune it with `python bench/"
                    "invariant_gemm_probe.py --out F --write-config kernels/"
                    "invariant_gemm_configs.json`, or run --batch-invariant off", device)


def build_engine(cfg: VerifyConfig, tracer_provider: TracerProvider | None = None
                 ) -> tuple[VerifyEngine, GenerationServicer]:
    path = resolve_model(cfg.model)
    device = pick_device(cfg.device)
    bind_device(device)
    model = Qwen3Model.from_pretrained(path, dtype=pick_dtype(cfg.dtype, device), device=device)
    busy = cfg.busy(device.type)
    link = DraftLink(cfg.draft, cfg.reconnect_s, cfg.step_deadline_ms / 1000,
                     model.spec.vocab_size, model.spec.num_layers, busy,
                     local=cfg.draft_socket != "off",
                     rejection=cfg.acceptance == "rejection",
                     tls=cfg.draft_tls, api_key=cfg.draft_api_key) if cfg.draft else None
    observer, metrics = build_observer(cfg, tracer_provider)
    gen = path / "generation_config.json"
    defaults = checkpoint_defaults(json.loads(gen.read_text())) \
        if cfg.generation_config == "auto" and gen.exists() else {}
    engine = VerifyEngine(model, cfg.num_blocks, cfg.block_size, cfg.max_batch,
                          cfg.max_model_len, cfg.prefill_tokens, link=link,
                          kernels=cfg.target_kernels, busy_poll=busy, observer=observer,
                          sampling_defaults=defaults,
                          max_waiting=cfg.max_waiting, speculation=cfg.speculation,
                          prefix_caching=cfg.prefix_caching)
    if device.type == "cuda":
        _warn_untuned(cfg, device)
        log.info("verify warm-up (plain decode's graphs, batch buckets to %d) took %.1f s",
                 cfg.max_batch, engine.verifier.warm_up())
    if metrics is not None:
        metrics.watch(engine)
        metrics.serve(cfg.host, cfg.metrics_port)
    return engine, GenerationServicer(engine, load_tokenizer(path), str(cfg.model),
                                      cfg.max_prompt_bytes)


async def start(cfg: VerifyConfig, tracer_provider: TracerProvider | None = None
                ) -> tuple[grpc.aio.Server, int, VerifyEngine]:
    """Build and start everything (for tests and run()); returns the bound port.

    Traces go to tracer_provider, by default the one the OTEL_* variables describe
    (none when tracing is off: see treespec.common.serving.telemetry). engine.stop() closes /metrics.
    """
    if tracer_provider is None:
        tracer_provider = tracer_provider_from_env(VERIFY_SERVICE_NAME)
    engine, servicer = build_engine(cfg, tracer_provider)
    if engine.link is not None:
        engine.link.start()
    engine.start()
    server, port = await start_server(
        cfg.host, cfg.port, lambda s: pb_grpc.add_GenerationServicer_to_server(servicer, s),
        [SERVICE], [TracingInterceptor(tracer_provider)] if tracer_provider else None,
        tls=cfg.server_tls, api_keys=cfg.api_keys, reflect=cfg.reflect,
        max_receive=cfg.max_prompt_bytes + REQUEST_ROOM)
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
