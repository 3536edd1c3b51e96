"""The event-loop helpers: spin_until polls without sleeping."""

from __future__ import annotations

import asyncio
import time

from treespec.common.serving.aio import spin_until


def test_spin_until_returns_once_the_condition_holds_and_lets_others_run():
    async def go():
        flag = []
        asyncio.get_running_loop().call_later(0.01, flag.append, 1)
        t0 = time.perf_counter()
        await spin_until(lambda: bool(flag))
        return time.perf_counter() - t0
    assert 0.009 < asyncio.run(go()) < 1.0
