"""The event-loop helpers: spin_until polls without sleeping; LoopSpinner keeps a
loop awake for hold_s after each keep_hot(), then lets it sleep again, rehearsing
while it spins."""

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


def test_loop_spinner_rehearses_while_hot_only_and_stops_on_a_failure(caplog):
    async def go():
        calls = []
        spinner = LoopSpinner(hold_s=0.05, rehearse=lambda: calls.append(1),
                              rehearse_every_s=0.005)
        spinner.keep_hot()
        await asyncio.sleep(0.2)              # 50 ms hot, then parked
        hot_calls = len(calls)
        await asyncio.sleep(0.1)
        parked_calls = len(calls) - hot_calls

        def broken():
            raise RuntimeError("boom")
        spinner.rehearse = broken
        spinner.keep_hot()
        await asyncio.sleep(0.06)
        off = spinner.rehearse is None
        spinner.keep_hot()                    # still spins, without rehearsing
        await asyncio.sleep(0.01)
        alive = not spinner._task.done()
        await spinner.close()
        return hot_calls, parked_calls, off, alive, spinner.rehearsals
    hot_calls, parked_calls, off, alive, count = asyncio.run(go())
    # about one per 5 ms over 50 ms: a few to a dozen (a slow CI loop rehearses less)
    assert 3 <= hot_calls <= 12 and parked_calls == 0 and count == hot_calls
    assert off and alive and "rehearsal is off" in caplog.text


def test_a_spinning_loop_leaves_the_gil_to_worker_threads():
    """A service's worker thread (a draft model's steps, a prefill) needs the GIL
    between its blocking calls; a spinning loop that held it through its quiet waits
    would make it wait a switch interval (5 ms) each time: 1.1 s here instead of 0.04."""
    import threading

    def worker(took: list[float]) -> None:
        t0 = time.perf_counter()
        for _ in range(200):
            time.sleep(0.0001)
            sum(range(200))
        took.append(time.perf_counter() - t0)

    async def go() -> float:
        spinner = LoopSpinner(hold_s=5.0, quiet_s=20e-6)
        spinner.keep_hot()
        took: list[float] = []
        th = threading.Thread(target=worker, args=(took,))
        th.start()
        await spin_until(lambda: not th.is_alive())
        await spinner.close()
        return took[0]
    assert asyncio.run(go()) < 0.5


def test_loop_spinner_stands_by_while_a_worker_computes_and_is_hot_after():
    """Inside standing_by() the loop neither spins nor rehearses (a spinning loop
    takes the GIL back between a worker's torch calls: on the CPU VM a worker's 3000
    small in-place adds took 62-70 ms beside a hot loop, 14 ms beside one standing
    by); keep_hot() meanwhile does not restart it; afterwards it is hot again."""
    async def go():
        calls = []
        spinner = LoopSpinner(hold_s=5.0, rehearse=lambda: calls.append(1),
                              rehearse_every_s=0.001)
        spinner.keep_hot()
        await asyncio.sleep(0.02)
        before = len(calls)
        with spinner.standing_by():
            with spinner.standing_by():          # nested: the outermost one counts
                await asyncio.sleep(0.01)
            spinner.keep_hot()
            await asyncio.sleep(0.03)
            during = len(calls) - before
            parked = not spinner._wake.is_set()
        hot = spinner._wake.is_set()
        await asyncio.sleep(0.02)
        after = len(calls) - before - during
        await spinner.close()
        return before, during, parked, hot, after
    before, during, parked, hot, after = asyncio.run(go())
    assert before > 0 and during == 0 and parked
    assert hot and after > 0


def test_a_turn_whose_poller_found_work_skips_rehearsal_and_quiet_wait():
    """A poller that found a message (returns true) sends the loop straight on to the
    task answering it: no rehearsal, no quiet wait in that turn."""
    async def go(found: bool) -> int:
        calls = []
        spinner = LoopSpinner(hold_s=5.0, rehearse=lambda: calls.append(1),
                              rehearse_every_s=0.0, pollers=[lambda: found])
        spinner.keep_hot()
        await asyncio.sleep(0.02)
        await spinner.close()
        return len(calls)
    assert asyncio.run(go(True)) == 0 and asyncio.run(go(False)) > 0
