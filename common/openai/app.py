"""The OpenAI-compatible routes, over a Generation client (AsyncTreespecClient).

    POST /v1/chat/completions   messages -> the checkpoint's chat template -> Generate
    POST /v1/completions        a prompt (text or token ids) -> Generate
    GET  /v1/models             the one served model
    GET  /health                200 while the verify's gRPC health says SERVING, else 503
    GET  /metrics               the front's counters (metrics.py)

The /v1 routes want ``Authorization: Bearer <key>`` when the front has keys. A
streamed response is server-sent events, ``data: {chunk}`` each, ending with
``data: [DONE]``; its first event waits for the first text, so a refusal by the
verify (400, 429, 503) still comes as an HTTP status. A client that goes away,
while its response is being computed or streamed, cancels the Generate call.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from treespec.common.client import Chunk, ServerInfo, TreespecError
from treespec.common.openai.errors import HANDLERS, APIError, from_rpc
from treespec.common.openai.metrics import FrontMetrics, MetricsMiddleware
from treespec.common.openai.protocol import (ChatRequest, CompletionRequest, Kind,
                                             ResponseShape, model_list, usage)
from treespec.common.openai.stream import Delta, deltas
from treespec.common.openai.translate import (Plan, chat_prompt, check_supported,
                                              completion_prompt, plan)

T = TypeVar("T")
CLIENT_GONE = 499                    # nginx's status for a client that closed first


class Generation(Protocol):
    """What the front needs of the verify (AsyncTreespecClient has it)."""

    def generate_stream(self, prompt: str | None = None, **kw: Any) -> AsyncIterator[Chunk]: ...

    async def wait_ready(self, timeout: float = 30.0, service: str = "") -> None: ...


@dataclass
class Gateway:
    """Everything the routes use."""

    client: Generation
    info: ServerInfo                  # the verify's GetInfo at start
    tokenizer: Any | None             # the checkpoint's (None: token-id prompts only)
    checkpoint: str                   # where the tokenizer came from, for messages
    served_model_name: str
    api_keys: tuple[bytes, ...] | None = None
    metrics: FrontMetrics = field(default_factory=FrontMetrics)
    # prompts are rendered and tokenized here, off the event loop
    tokenize: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize"))


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends (done,
    client gone, server stopping), so the Generate call under it is cancelled at once."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """work's result, or None (work cancelled) if the client disconnects first."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    return task.result() if not task.cancelled() else None


async def collect(source: AsyncIterator[Delta]) -> tuple[str, Delta]:
    parts: list[str] = []
    async with aclosing(source):
        async for d in source:
            parts.append(d.text)
    return "".join(parts), d


async def events(shape: ResponseShape, first: Delta, source: AsyncIterator[Delta],
                 prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
    chat = shape.kind == "chat"
    d = first
    try:
        if chat:
            yield event(shape.chunk("", first=True, with_usage=include_usage))
        while True:
            if d.text:
                yield event(shape.chunk(d.text, with_usage=include_usage))
            if d.finish_reason is not None:
                yield event(shape.chunk(None if chat else "", d.finish_reason, stats=d.stats,
                                        with_usage=include_usage))
                if include_usage:
                    yield event(shape.usage_chunk(usage(prompt_tokens, d.completion_tokens,
                                                             d.stats)))
                break
            d = await anext(source)
    except TreespecError as e:
        yield event(from_rpc(e).body)
    finally:
        await source.aclose()
    yield "data: [DONE]\n\n"


def build_app(gw: Gateway) -> FastAPI:
    app = FastAPI(title="treespec OpenAI-compatible API", docs_url=None, redoc_url=None,
                  openapi_url=None, exception_handlers=HANDLERS)
    app.add_middleware(MetricsMiddleware, metrics=gw.metrics)

    async def authorized(request: Request) -> None:
        if gw.api_keys is None:
            return
        given = request.headers.get("authorization", "")
        token = given[len("Bearer "):].encode() if given.startswith("Bearer ") else b""
        ok = False
        for k in gw.api_keys:               # every key compared: the time says nothing
            ok |= hmac.compare_digest(token, k)
        if not ok:
            raise APIError(401, "missing or unknown API key (header 'Authorization: "
                                "Bearer <key>')", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    def check_model(name: str | None) -> None:
        if name is not None and name != gw.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist here; this server "
                                f"serves {gw.served_model_name!r}", param="model",
                           code="model_not_found")

    async def off_loop(fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(gw.tokenize, fn, *args)

    async def respond(kind: Kind, req: ChatRequest | CompletionRequest, p: Plan,
                      request: Request, arrived: float) -> Response:
        shape = ResponseShape(kind, gw.served_model_name)
        source = deltas(gw.client.generate_stream(prompt_ids=p.prompt_ids, request_id=shape.id,
                                                  **p.args), gw.tokenizer, p.stops)
        try:
            if not req.stream:
                done = await unless_disconnected(request, collect(source))
                if done is None:
                    return Response(status_code=CLIENT_GONE)
                text, last = done
                return JSONResponse(shape.completion(
                    text, last.finish_reason or "stop",
                    usage(len(p.prompt_ids), last.completion_tokens, last.stats), last.stats))
            first = await unless_disconnected(request, anext(source))
        except TreespecError as e:
            await source.aclose()
            raise from_rpc(e) from None
        if first is None:
            await source.aclose()
            return Response(status_code=CLIENT_GONE)
        gw.metrics.ttft.labels(request.url.path).observe(time.perf_counter() - arrived)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return EventStream(events(shape, first, source, len(p.prompt_ids), include_usage),
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        check_model(req.model)
        check_supported(req)
        ids = await off_loop(chat_prompt, gw.tokenizer, req, gw.checkpoint)
        return await respond("chat", req, plan(req, ids, gw.tokenizer, gw.info.max_model_len),
                             request, arrived)

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        check_model(req.model)
        check_supported(req)
        ids = await off_loop(completion_prompt, gw.tokenizer, req)
        return await respond("completion", req,
                             plan(req, ids, gw.tokenizer, gw.info.max_model_len), request,
                             arrived)

    @v1.get("/models")
    async def models() -> dict:
        return model_list(gw.served_model_name)

    @app.get("/health")
    async def health() -> Response:
        try:
            await gw.client.wait_ready(timeout=1.0)
        except (TimeoutError, TreespecError) as e:
            return JSONResponse({"status": "unavailable", "verify": str(e)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gw.metrics.exposition(), media_type=gw.metrics.content_type)

    app.include_router(v1)
    return app
