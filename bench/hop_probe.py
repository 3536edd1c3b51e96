"""How long one draft round trip takes between two processes on this host, by carrier.

    python bench/hop_probe.py [--out FILE] [--gap-ms 5] [--iters 200]

A child process echoes each message back (a reply of --reply bytes); the parent times
the round trip after a gap of --gap-ms, spent either spinning its event loop (as the
verify service does through a forward when busy polling) or sleeping. Both loops are
kept hot with common.aio.LoopSpinner, as the services keep theirs. Carriers:

  grpc   a grpc.aio bidi stream on loopback TCP (what the Speculate stream uses)
  unix   length-prefixed frames on a Unix domain socket, read by the event loop itself
  shm    common/mailbox.py's shared-memory mailbox, each side polling with sched_yield
         between looks (no event loop, no socket): what the carrier itself costs

The question it answers: how much of the in-step hop is the carrier's thread wake-ups
(gRPC core's poller and executor threads sleep through a forward; a Unix socket read by
a spinning loop needs no thread to wake), and how much is Python on either side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from common.aio import LoopSpinner, spin_until  # noqa: E402
from common.mailbox import TO_DRAFT, TO_VERIFY, Mailbox  # noqa: E402

METHOD = "/treespec.bench.Echo/Stream"
_LEN = struct.Struct("<I")


def _reply(size: int) -> bytes:
    return b"r" * size


async def _grpc_server(port_q, reply: int) -> None:
    spinner = LoopSpinner(0.05)
    body = _reply(reply)

    async def stream(it, ctx):
        async for _ in it:
            spinner.keep_hot()
            yield body

    handler = grpc.method_handlers_generic_handler("treespec.bench.Echo", {
        "Stream": grpc.stream_stream_rpc_method_handler(stream)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_q.put(f"127.0.0.1:{port}")
    await server.wait_for_termination()


async def _unix_server(path: str, port_q, reply: int) -> None:
    spinner = LoopSpinner(0.05)
    body = _reply(reply)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                await reader.readexactly(n)
            except asyncio.IncompleteReadError:
                return
            spinner.keep_hot()
            writer.write(_LEN.pack(len(body)) + body)

    server = await asyncio.start_unix_server(serve, path)
    port_q.put(path)
    async with server:
        await server.serve_forever()


def _shm_server(path: str, port_q, reply: int) -> None:
    """Polls the request mailbox with sched_yield between looks: no event loop and
    no system call but the yield (bench/cold_probe.py: the cheapest kind of wait)."""
    mb = Mailbox.attach(path)
    body = _reply(reply)
    port_q.put(path)
    while True:
        if mb.take(TO_DRAFT) is None:
            os.sched_yield()
            continue
        mb.post(TO_VERIFY, body)


def _child(kind: str, path: str, port_q, reply: int) -> None:
    if kind == "grpc":
        asyncio.run(_grpc_server(port_q, reply))
    elif kind == "shm":
        _shm_server(path, port_q, reply)
    else:
        asyncio.run(_unix_server(path, port_q, reply))


async def _gap(seconds: float, spin: bool) -> None:
    if not seconds:
        return
    if spin:
        end = time.perf_counter() + seconds
        await spin_until(lambda: time.perf_counter() >= end)
    else:
        await asyncio.sleep(seconds)


async def _time_grpc(addr: str, size: int, iters: int, gap_s: float, spin: bool) -> list[float]:
    async with grpc.aio.insecure_channel(addr) as ch:
        call = ch.stream_stream(METHOD)()
        body, times = b"q" * size, []
        for _ in range(iters):
            await _gap(gap_s, spin)
            t0 = time.perf_counter()
            await call.write(body)
            await call.read()
            times.append(time.perf_counter() - t0)
        await call.done_writing()
    return times


async def _time_unix(path: str, size: int, iters: int, gap_s: float, spin: bool) -> list[float]:
    reader, writer = await asyncio.open_unix_connection(path)
    body, times = b"q" * size, []
    for _ in range(iters):
        await _gap(gap_s, spin)
        t0 = time.perf_counter()
        writer.write(_LEN.pack(len(body)) + body)
        (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        await reader.readexactly(n)
        times.append(time.perf_counter() - t0)
    writer.close()
    return times


async def _time_shm(path: str, size: int, iters: int, gap_s: float, spin: bool) -> list[float]:
    mb = Mailbox.attach(path)
    body, times = b"q" * size, []
    for _ in range(iters):
        await _gap(gap_s, spin)
        t0 = time.perf_counter()
        mb.post(TO_DRAFT, body)
        while mb.take(TO_VERIFY) is None:
            os.sched_yield()
        times.append(time.perf_counter() - t0)
    mb.close()
    return times


def _summary(times: list[float]) -> dict:
    t = sorted(1000 * x for x in times[10:])
    return {"p50_ms": t[len(t) // 2], "p90_ms": t[int(len(t) * 0.9)], "min_ms": t[0]}


def probe(kind: str, size: int, reply: int, iters: int, gaps_ms: list[float]) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = os.path.join(tempfile.mkdtemp(prefix="treespec-hop-"), "s")
    shm = Mailbox.create() if kind == "shm" else None     # common/mailbox.py's
    if shm is not None:
        path = shm.path
    child = ctx.Process(target=_child, args=(kind, path, q, reply), daemon=True)
    child.start()
    try:
        addr = q.get(timeout=60)
        timer = {"grpc": _time_grpc, "shm": _time_shm}.get(kind, _time_unix)
        out = {}
        for gap in gaps_ms:
            for spin in ([False, True] if gap else [False]):
                label = f"gap{gap:g}_{'spin' if spin else 'sleep'}" if gap else "back_to_back"
                out[label] = _summary(asyncio.run(timer(addr, size, iters, gap / 1000, spin)))
                print(kind, label, out[label], flush=True)
        return out
    finally:
        child.terminate()
        child.join(5)
        if shm is not None:
            shm.unlink()
            shm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--gap-ms", default="0,5")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--size", type=int, default=600, help="request bytes (one sequence's)")
    ap.add_argument("--reply", type=int, default=300, help="proposal bytes")
    ap.add_argument("--carriers", default="grpc,unix,shm")
    a = ap.parse_args()
    gaps = [float(g) for g in a.gap_ms.split(",")]
    res = {"cpus": os.cpu_count(), "size": a.size, "reply": a.reply}
    for kind in a.carriers.split(","):
        res[kind] = probe(kind, a.size, a.reply, a.iters, gaps)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
