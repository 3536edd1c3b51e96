"""The event-loop helpers: spin_until polls without sleeping; LoopSpinner keeps a
loop awake for hold_s after each keep_hot(), then lets it sleep again."""

from __future__ import annotations

import asyncio
import time

from common.aio import LoopSpinner, spin_until


def test_spin_until_returns_once_the_condition_holds_and_lets_others_run():
    async def go():
        flag = []
        asyncio.get_running_loop().call_later(0.01, flag.append, 1)
        t0 = time.perf_counter()
        await spin_until(lambda: bool(flag))
        return time.perf_counter() - t0
    assert 0.009 < asyncio.run(go()) < 1.0


def test_loop_spinner_spins_while_hot_and_stops_after_hold():
    async def go():
        loop = asyncio.get_running_loop()
        spinner = LoopSpinner(hold_s=0.05)
        ticks = 0

        def tick():              # a callback that reschedules itself via call_soon only
            nonlocal ticks       # runs often if the loop never blocks in select
            ticks += 1
        spinner.keep_hot()
        t0 = loop.time()
        while loop.time() - t0 < 0.03:
            loop.call_soon(tick)
            await asyncio.sleep(0)
        hot = spinner._wake.is_set()
        await asyncio.sleep(0.1)              # past hold_s: the spinner parks
        parked = not spinner._wake.is_set() and not spinner._task.done()
        spinner.keep_hot()                    # and wakes again
        rewoken = spinner._wake.is_set()
        await spinner.close()
        return hot, parked, rewoken, ticks
    hot, parked, rewoken, ticks = asyncio.run(go())
    assert hot and parked and rewoken and ticks > 10
