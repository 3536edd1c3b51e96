"""A bounded soak on loopback: 200 concurrent streams against a verify service whose
n-gram draft (a `treespec draft` process) is killed and restarted on the same port
every second or so, with a fifth of the streams cancelled by their clients midway.
Every stream that finishes carries plain decode's tokens, none is lost, and when it is
over the verify service holds no KV page."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from common.client import AsyncTreespecClient
from common.launch import ServiceProcess, cli_command
from parallel_services import free_port

STREAMS = 200
PROMPTS = [[1 + (i * 7 + k) % 40 for k in range(6)] * 2 for i in range(8)]   # repeats


def start_draft(port: int) -> ServiceProcess:
    d = ServiceProcess("draft", cli_command("draft", "--method", "ngram", "--port", str(port),
                                            "--device", "cpu"))
    d.wait_listening(60)
    return d


@pytest.mark.timeout(300)
def test_soak_with_a_draft_that_keeps_dying(target_dir):
    port = free_port()
    holder = {"draft": start_draft(port)}
    rng = random.Random(0)

    async def go():
        from verify_service import server as verify_server
        from verify_service.config import VerifyConfig
        vs, vport, engine = await verify_server.start(VerifyConfig(
            model=str(target_dir), draft=f"127.0.0.1:{port}", device="cpu", block_size=4,
            num_blocks=4096, max_batch=64, reconnect_s=0.2, step_deadline_ms=2000))
        addr = f"127.0.0.1:{vport}"
        try:
            async with AsyncTreespecClient(addr) as c:
                want = [(await c.generate(prompt_ids=p, max_tokens=40, ignore_eos=True,
                                          no_speculation=True)).token_ids for p in PROMPTS]
                done = asyncio.Event()

                async def chaos():
                    kills, wait = 0, 0.3            # the first kill early: streams are short
                    while not done.is_set():
                        await asyncio.sleep(wait)
                        wait = 1.0
                        holder["draft"].proc.kill()
                        holder["draft"].stop(1)
                        kills += 1
                        holder["draft"] = await asyncio.to_thread(start_draft, port)
                    return kills

                async def stream(i: int):
                    p = i % len(PROMPTS)
                    n = rng.randint(8, 40)
                    cut = rng.randint(1, 5) if rng.random() < 0.2 else None
                    got, chunks, final = [], 0, None
                    async for chunk in c.generate_stream(prompt_ids=PROMPTS[p], max_tokens=n,
                                                         ignore_eos=True):
                        got += chunk.token_ids
                        chunks += 1
                        final = chunk
                        if cut is not None and chunks >= cut:
                            return "cancelled", got, want[p][:len(got)], None
                    return "done", got, want[p][:n], final

                killer = asyncio.create_task(chaos())
                t0 = time.monotonic()
                results = await asyncio.gather(*(stream(i) for i in range(STREAMS)))
                done.set()
                kills = await killer
                took = time.monotonic() - t0
                for _ in range(100):           # cancelled streams' pages return next step
                    if engine.kv_pages_used == 0 and not engine.running:
                        break
                    await asyncio.sleep(0.05)
                return results, kills, took, engine.kv_pages_used, dict(engine.fallbacks)
        finally:
            await vs.stop(0.5)
            await engine.stop()
            if engine.link is not None:
                await engine.link.close()

    try:
        results, kills, took, pages, fallbacks = asyncio.run(go())
    finally:
        holder["draft"].stop(2)
    assert len(results) == STREAMS
    for kind, got, want, final in results:
        assert got == want, kind                   # not one wrong token
        if kind == "done":
            assert final.finish_reason == "length"
    assert kills >= 1, took
    assert any(f is not None and f.stats["draft_tokens"] for *_, f in results)  # it drafted
    assert fallbacks.get("disconnected", 0) > 0, fallbacks                      # and died
    assert sum(r[0] == "done" for r in results) >= STREAMS // 2
    assert pages == 0, fallbacks
