"""Where the verify engine's compute runs: a single worker thread, or the event loop.

Prefill and graph captures run in the worker thread (they take long enough to
stall the loop). With busy polling (by default on CUDA) a step whose graph is
already captured is launched from the event loop, which then polls the device's
completion event without sleeping: a thread woken when the GPU answers costs
tens of microseconds to a millisecond on every step's critical path.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from treespec.common.serving.aio import spin_until
from treespec.verify_service.verifier import StepResult, Verifier, VerifyBatch


class StepRunner:
    def __init__(self, verifier: Verifier, busy_poll: bool) -> None:
        self.verifier = verifier
        self.busy_poll = busy_poll
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="treespec-verify")

    async def compute(self, fn, *args):
        """fn(*args) in the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def step(self, batch: VerifyBatch) -> StepResult:
        """verifier.step, launched from the loop and polled when busy polling and its
        graph is captured (a capture takes seconds: that one runs in the worker)."""
        if not (self.busy_poll and self.verifier.has_graph(batch)):
            return await self.compute(self.verifier.step, batch)
        pending = self.verifier.launch(batch)
        await spin_until(pending.ready)
        return self.verifier.finish(pending)

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
