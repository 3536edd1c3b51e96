"""Small asyncio helpers shared by the services."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger("treespec.aio")


async def spin_until(done: Callable[[], bool]) -> None:
    """Yield to the event loop until done() is true, never sleeping: other tasks and
    I/O still run between polls, and nothing waits for a thread to wake up."""
    while not done():
        await asyncio.sleep(0)


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has finished, whatever it raised."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


# Between two turns of a spinning loop, yield the CPU (sched_yield) for this long
# before the loop polls epoll again: on the H200 host, code run after a 5 ms gap of
# epoll polling took 1.5 x as long as after a gap of sched_yield calls (235 against
# 130 us, bench/cold_probe.py). A message waits at most this long for the loop to see
# it. Not a pure-Python wait: that keeps the GIL from the service's worker thread for
# a whole switch interval (5 ms) at a time, and a draft model's steps took 2 x as long.
# TREESPEC_SPIN_QUIET_US=0 polls at every turn.
SPIN_QUIET_S = float(os.environ.get("TREESPEC_SPIN_QUIET_US", "20")) / 1e6


def _wait_quietly(seconds: float) -> None:
    """Spin for seconds without epoll, releasing the GIL at every turn."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        os.sched_yield()


async def in_worker(pool, spinner: LoopSpinner | None, fn, *args):
    """fn(*args) in the executor pool; a busy loop's spinner stands by meanwhile."""
    run = asyncio.get_running_loop().run_in_executor
    if spinner is None:
        return await run(pool, fn, *args)
    with spinner.standing_by():
        return await run(pool, fn, *args)


class LoopSpinner:
    """Keeps an event loop from sleeping for a while after each ``keep_hot()``.

    A service that answers a peer every few milliseconds pays a thread wake-up
    each time its loop has gone to sleep in the kernel between messages (tens of
    microseconds on bare metal, up to a millisecond on a VM), on the peer's
    critical path. While hot, a background task yields to the loop without
    sleeping, so the loop keeps polling I/O with a zero timeout and picks up the
    next message as soon as gRPC's poller hands it over. Idle longer than
    ``hold_s``, the loop sleeps as usual: the cost is one busy core while traffic
    flows, nothing when it stops.

    Awake is not enough: code that last ran a forward ago (5 ms) runs 3-5 x slower
    than in a loop, its instructions and data evicted from the core's caches
    meanwhile (bench/cold_probe.py: 144 us back to back, 500-600 us after 5 ms of
    sleeping or of spinning in pure Python, 150-170 us when the same work was
    rehearsed every 0.05-1 ms). So while hot the spinner also calls ``rehearse``
    every ``rehearse_every_s``: the service's per-step host work on throwaway data,
    keeping that code warm for the real message. The first exception turns
    rehearsal off (logged): it is an optimisation and must never cost a step.

    While the service's worker thread computes (a prefill, a draft model's step),
    the loop stands by (``standing_by``) instead: a spinning loop wants the GIL
    back at every turn, and a worker that releases it around each torch call
    then waits for it, up to a switch interval (5 ms) at a time.
    """

    def __init__(self, hold_s: float = 0.02, rehearse: Callable[[], None] | None = None,
                 rehearse_every_s: float = 0.001, quiet_s: float | None = None,
                 pollers: list[Callable[[], bool | None]] | None = None) -> None:
        self.hold_s = hold_s
        # called at every turn; one that returns true found work: no rehearsal or quiet
        # wait in that turn
        self.pollers = pollers if pollers is not None else []
        self.quiet_s = SPIN_QUIET_S if quiet_s is None else quiet_s
        self.rehearse = rehearse
        self.rehearse_every_s = rehearse_every_s
        self.rehearsals = 0
        self._until = 0.0
        self._standing_by = 0           # workers computing for this loop right now
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def keep_hot(self) -> None:
        """Spin the running loop until hold_s from now (starts the task if needed)."""
        loop = asyncio.get_running_loop()
        self._until = loop.time() + self.hold_s
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._spin())
        self._wake.set()

    async def _spin(self) -> None:
        loop = asyncio.get_running_loop()
        due = 0.0
        while True:
            await self._wake.wait()
            while (now := loop.time()) < self._until and not self._standing_by:
                found = False
                for poll in self.pollers:
                    found = bool(poll()) or found
                if found:           # straight on to the task that answers it
                    await asyncio.sleep(0)
                    continue
                if self.rehearse is not None and now >= due:
                    self._rehearse()
                    due = loop.time() + self.rehearse_every_s
                if self.quiet_s:
                    _wait_quietly(self.quiet_s)
                await asyncio.sleep(0)
            self._wake.clear()

    @contextlib.contextmanager
    def standing_by(self):
        """No spinning inside this block (a worker thread computes); hot after it."""
        self._standing_by += 1
        try:
            yield
        finally:
            self._standing_by -= 1
            if not self._standing_by:
                self.keep_hot()

    def _rehearse(self) -> None:
        try:
            self.rehearse()
            self.rehearsals += 1
        except Exception:  # noqa: BLE001 - never let a warm-up break serving
            log.exception("rehearsing the step's host work failed; rehearsal is off")
            self.rehearse = None

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
