"""Running the OpenAI front: reach the verify, load the tokenizer, serve on uvicorn.

At start the front waits for the verify's gRPC health (``wait_verify_s``), reads its
GetInfo (context length, model) and loads the tokenizer of ``cfg.model``, or of the
checkpoint GetInfo names when that is unset (it must then resolve on this host, as a
shipped name or a directory at the same path). Once bound it prints
``listening on HOST:PORT`` as its first stdout line (port 0 picks one). SIGTERM or
SIGINT: stop accepting, let running responses finish for ``grace_s``, cancel the
rest (their Generate calls with them), close the channel, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn

from treespec.common.client import AsyncTreespecClient
from treespec.common.model.paths import resolve_model
from treespec.common.model.tokenizer import load_tokenizer
from treespec.common.openai.app import Gateway, build_app
from treespec.common.openai.config import OpenAIConfig

log = logging.getLogger("treespec.openai")


class _Server(uvicorn.Server):
    """uvicorn's server with the process's signal handling left to `serve` (uvicorn's
    own re-raises the signal once stopped, so the process would not exit 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def gateway(cfg: OpenAIConfig, client: AsyncTreespecClient) -> Gateway:
    """What the routes need, once the verify answers."""
    await client.wait_ready(cfg.wait_verify_s)
    info = await client.info()
    name = cfg.model or info.model
    try:
        path = resolve_model(name)
    except FileNotFoundError as e:
        raise ValueError(f"the tokenizer's checkpoint: {e}" + (
            "" if cfg.model else " (the verify's --model, from its GetInfo; pass --model "
                                 "naming the same checkpoint on this host)")) from None
    tokenizer = await asyncio.to_thread(load_tokenizer, path)
    log.info("verify %s serves %s (context %d); tokenizer from %s%s", cfg.verify,
             info.model, info.max_model_len, path,
             "" if tokenizer is None or tokenizer.chat_template else " (no chat template)")
    return Gateway(client, info, tokenizer, str(name), cfg.served_model_name or str(name),
                   cfg.api_keys)


async def serve(cfg: OpenAIConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with AsyncTreespecClient(cfg.verify, tls=cfg.verify_tls,
                                   api_key=cfg.verify_api_key) as client:
        ready = asyncio.ensure_future(gateway(cfg, client))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait((ready, stopped), return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():                     # stopped while waiting for the verify
            ready.cancel()
            return
        stopped.cancel()
        server = _Server(uvicorn.Config(
            build_app(ready.result()), host=cfg.host, port=cfg.port, log_config=None,
            access_log=False, lifespan="off", timeout_graceful_shutdown=cfg.grace_s))
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            if task.done():
                task.result()
                raise OSError(f"could not serve on {cfg.host}:{cfg.port}")
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        print(f"listening on {cfg.host}:{port}", flush=True)
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        log.info("stopping: %.1fs grace for running responses", cfg.grace_s)
        server.should_exit = True
        await task
        waiter.cancel()


def run(cfg: OpenAIConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(cfg))
    else:
        uvloop.run(serve(cfg))
