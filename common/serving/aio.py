"""Small asyncio helpers shared by the services."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


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
