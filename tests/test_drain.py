"""A request the server's stop cuts short ends UNAVAILABLE (the SDK raises), never as
a finished stream that looks complete; its pages return."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from treespec.common.client import AsyncTreespecClient, TreespecError
from inproc import services


def test_a_stopped_server_ends_running_streams_unavailable(target_dir):
    async def go():
        async with services(target_dir) as h:
            engine = h["engine"]
            before = engine.cache.blocks.num_free
            async with AsyncTreespecClient(h["addr"]) as c:
                got: list[int] = []

                async def long():
                    async for chunk in c.generate_stream(prompt_ids=[1, 2, 3],
                                                         max_tokens=400, ignore_eos=True):
                        got.extend(chunk.token_ids)
                        if len(got) >= 5 and not engine._stopping:
                            asyncio.get_running_loop().create_task(engine.stop())

                with pytest.raises(TreespecError) as err:
                    await long()
                return err.value, got, engine.cache.blocks.num_free, before
    err, got, free, before = asyncio.run(go())
    assert err.code == grpc.StatusCode.UNAVAILABLE and "stopped" in err.details
    assert 5 <= len(got) < 400
    assert free == before                           # every page back


def test_requests_beyond_max_waiting_are_resource_exhausted(target_dir):
    """max_batch 1 and max_waiting 2: of 6 concurrent requests at most one runs and two
    wait (two, if none was admitted yet when the rest came); the others are refused at
    once with RESOURCE_EXHAUSTED, and the admitted ones finish."""
    async def go():
        async with services(target_dir, max_batch=1, max_waiting=2) as h:
            async with AsyncTreespecClient(h["addr"]) as c:
                async def one():
                    try:
                        return len((await c.generate(prompt_ids=[1, 2, 3], max_tokens=30,
                                                     ignore_eos=True)).token_ids)
                    except TreespecError as e:
                        return e.code
                return await asyncio.gather(*(one() for _ in range(6)))
    got = asyncio.run(go())
    ok = [g for g in got if g == 30]
    assert 2 <= len(ok) <= 3, got
    assert all(g == grpc.StatusCode.RESOURCE_EXHAUSTED for g in got if g != 30), got


def test_the_draft_forgets_a_finished_request_without_waiting_for_a_next_step(target_dir,
                                                                              draft_dir):
    async def go():
        async with services(target_dir, "model", draft_model=draft_dir) as h:
            async with AsyncTreespecClient(h["addr"]) as c:
                await c.generate(prompt_ids=[1, 5, 9, 13, 2, 7], max_tokens=12)
                held = h["draft_engine"].num_sequences
                for _ in range(100):
                    if h["draft_engine"].num_sequences == 0:
                        break
                    await asyncio.sleep(0.02)
                return held, h["draft_engine"].num_sequences, \
                    h["draft_engine"].proposer.cache.blocks.num_used
    held, after, pages = asyncio.run(go())
    assert after == 0 and pages <= 1, (held, after, pages)    # the scratch page only


def test_a_client_deadline_ends_the_request_and_returns_its_pages(target_dir):
    async def go():
        async with services(target_dir) as h:
            engine = h["engine"]
            async with AsyncTreespecClient(h["addr"]) as c:
                t0 = asyncio.get_running_loop().time()
                with pytest.raises(TreespecError) as err:
                    await c.generate(prompt_ids=[1, 2, 3], max_tokens=100_000, ignore_eos=True,
                                     timeout=0.5)
                took = asyncio.get_running_loop().time() - t0
                for _ in range(100):
                    if engine.kv_pages_used == 0 and not engine.running:
                        break
                    await asyncio.sleep(0.02)
                return err.value, took, engine.kv_pages_used, len(engine.running)
    err, took, pages, running = asyncio.run(go())
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and took < 2.0
    assert pages == 0 and running == 0


def test_2000_simultaneous_calls_each_get_an_answer(target_dir):
    """A flood past --max-waiting: every call is served or refused RESOURCE_EXHAUSTED;
    none is dropped by the transport (bare CANCELLED, uncounted). --max-waiting 100: most
    calls are refused even where the engine drains its queue fast."""
    async def go():
        async with services(target_dir, max_waiting=100) as h:
            async with AsyncTreespecClient(h["addr"]) as c:
                async def one():
                    try:
                        await c.generate(prompt_ids=[1, 2, 3], max_tokens=2)
                        return "OK"
                    except TreespecError as e:
                        return e.code.name
                return await asyncio.gather(*(one() for _ in range(2000)))
    got = asyncio.run(go())
    assert set(got) == {"OK", "RESOURCE_EXHAUSTED"}, {g: got.count(g) for g in set(got)}
