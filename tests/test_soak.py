"""A bounded soak on loopback: 500 concurrent streams (two rounds of 250) against a
verify service whose draft model (a `treespec draft` process) is killed and
restarted on the same port while they run (early in each round, then a second after
each restart: every round sees a kill), with a fifth of the streams cancelled
by their clients midway. Every stream that finishes carries plain decode's tokens,
none is lost, the verify service holds no KV page after each round and its memory
does not grow from the first round to the second; then, with the draft left alone,
a last round leaves the draft holding no sequence and no page either."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time

import pytest

from treespec.common.client import AsyncTreespecClient
from treespec.common.serving.launch import ServiceProcess, cli_command
from parallel_services import free_port
from prom import scrape, value

ROUNDS, STREAMS = 2, 250
PROMPTS = [[1 + (i * 7 + k) % 40 for k in range(6)] * 2 for i in range(8)]   # repeats


def start_draft(port: int, model_dir, metrics_port: int) -> ServiceProcess:
    d = ServiceProcess("draft", cli_command(
        "draft", "--method", "model", "--model", str(model_dir), "--port", str(port),
        "--device", "cpu", "--num-blocks", "512", "--metrics-port", str(metrics_port)))
    d.wait_listening(60)
    return d


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def draft_gauges(metrics_port: int) -> dict[str, float]:
    m = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    return {name: value(m, f"treespec:{name}") for name in ("draft_sequences", "kv_pages_used")}


@pytest.mark.timeout(300)
def test_soak_with_a_draft_that_keeps_dying(target_dir, draft_dir):
    port, mport = free_port(), free_port()
    holder = {"draft": start_draft(port, draft_dir, mport)}
    rng = random.Random(0)

    async def go():
        from treespec.verify_service import server as verify_server
        from treespec.verify_service.config import VerifyConfig
        vs, vport, engine = await verify_server.start(VerifyConfig(
            model=str(target_dir), draft=f"127.0.0.1:{port}", device="cpu", block_size=4,
            num_blocks=4096, max_batch=64, reconnect_s=0.2, step_deadline_ms=2000))
        addr = f"127.0.0.1:{vport}"
        idle = draft_gauges(mport)          # a fresh draft's (its scratch page counts)
        try:
            async with AsyncTreespecClient(addr) as c:
                want = [(await c.generate(prompt_ids=p, max_tokens=40, ignore_eos=True,
                                          no_speculation=True)).token_ids for p in PROMPTS]

                async def chaos(round_over: asyncio.Event) -> int:
                    """Kills the draft 0.3 s into a round (early: streams are short), then
                    a second after each restart, until the round's streams have ended;
                    returns with a draft running again, having counted only the kills that
                    came while streams ran. Tied to the round, not to the clock: however
                    fast the streams go (or slow a restart is), every round sees one."""
                    kills, wait = 0, 0.3
                    while True:
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(round_over.wait(), wait)
                        if round_over.is_set():
                            return kills
                        wait = 1.0
                        holder["draft"].proc.kill()
                        holder["draft"].stop(1)
                        kills += 1
                        holder["draft"] = await asyncio.to_thread(start_draft, port,
                                                                  draft_dir, mport)

                async def connected():           # a (restarted) draft, left alone, connects
                    for _ in range(200):
                        if engine.link.ready:
                            break
                        await asyncio.sleep(0.05)

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

                async def settle():              # cancelled streams' pages return next step
                    for _ in range(100):
                        if engine.kv_pages_used == 0 and not engine.running:
                            break
                        await asyncio.sleep(0.05)
                    return engine.kv_pages_used

                t0 = time.monotonic()
                results, pages, rss, kills = [], [], [], 0
                for _ in range(ROUNDS):
                    await connected()            # each round starts with a live draft
                    round_over = asyncio.Event()
                    killer = asyncio.create_task(chaos(round_over))
                    results += await asyncio.gather(*(stream(i) for i in range(STREAMS)))
                    round_over.set()
                    kills += await killer
                    pages.append(await settle())
                    gc.collect()
                    rss.append(rss_mb())
                took = time.monotonic() - t0
                fallbacks = dict(engine.fallbacks)
                await connected()                # the last draft, left alone
                last = await asyncio.gather(*(stream(i) for i in range(20)))
                pages.append(await settle())
                for _ in range(100):             # ended requests reach the draft (idle step)
                    gauges = draft_gauges(mport)
                    if gauges == idle:
                        break
                    await asyncio.sleep(0.05)
                return results, last, kills, took, pages, rss, fallbacks, gauges, idle
        finally:
            await vs.stop(0.5)
            await engine.stop()
            if engine.link is not None:
                await engine.link.close()

    try:
        results, last, kills, took, pages, rss, fallbacks, gauges, idle = asyncio.run(go())
    finally:
        holder["draft"].stop(2)
    assert len(results) == ROUNDS * STREAMS
    for kind, got, want, final in results + last:
        assert got == want, kind                   # not one wrong token
        if kind == "done":
            assert final.finish_reason == "length"
    assert kills >= ROUNDS, took                # a kill mid-streams in every round
    assert any(f is not None and f.stats["draft_tokens"] for *_, f in results)  # it drafted
    assert fallbacks.get("disconnected", 0) > 0, fallbacks                      # and died
    assert sum(r[0] == "done" for r in results) >= len(results) // 2
    assert pages == [0] * (ROUNDS + 1), (pages, fallbacks)
    assert rss[-1] - rss[0] < 64, rss              # MB: flat from one round to the next
    assert any(f is not None and f.stats["draft_tokens"] for *_, f in last)
    assert idle["draft_sequences"] == 0 and gauges == idle, (gauges, idle)
