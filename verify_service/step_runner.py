"""Where the verify engine's compute runs: a single worker thread, or the event loop.

Prefill and graph captures always run in the worker thread (they take long enough
to stall the loop). With busy polling (by default on CUDA) the event loop does not
sleep while steps flow (common.aio.LoopSpinner), and a fixed step whose graph is
already captured is launched from the loop, which then polls the device's
completion event: a sleeping thread costs a wake-up (tens of microseconds to a
millisecond on a VM) each time the GPU answers, on every step's critical path.
It keeps one core busy while requests run.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from common.aio import LoopSpinner, in_worker, spin_until
from common.kv_cache import SeqPages
from verify_service.graph_verifier import GraphVerifier
from verify_service.verifier import StepResult, Verifier


class StepRunner:
    def __init__(self, verifier: Verifier, busy_poll: bool,
                 rehearse: Callable[[], None] | None = None) -> None:
        self.verifier = verifier
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="treespec-verify")
        # rehearse: the hop's host work, kept warm while the loop spins (common.aio)
        self._spinner = LoopSpinner(rehearse=rehearse) if busy_poll else None
        # launch captured steps from the loop (fixed steps only)
        self.poll_device = busy_poll and isinstance(verifier, GraphVerifier)

    @property
    def rehearsals(self) -> int:
        """How many times the spinning loop has rehearsed the hop so far."""
        return self._spinner.rehearsals if self._spinner is not None else 0

    def keep_hot(self) -> None:
        """A step begins: keep the loop awake through its hop and forward."""
        if self._spinner is not None:
            self._spinner.keep_hot()

    async def compute(self, fn, *args):
        """fn(*args) in the worker thread (the loop stands by meanwhile: common.aio)."""
        return await in_worker(self._pool, self._spinner, fn, *args)

    async def step(self, pages: list[SeqPages], roots: list[int], tokens: torch.Tensor | None,
                   parents: torch.Tensor | None, depth: int) -> StepResult:
        """verifier.step, launched from the loop and polled when busy polling and its
        graph is captured (a capture takes seconds: that one runs in the worker)."""
        n = 0 if tokens is None else tokens.shape[1]
        if not (self.poll_device and self.verifier.captured(pages, n)):
            return await self.compute(self.verifier.step, pages, roots, tokens, parents, depth)
        pending = self.verifier.launch(pages, roots, tokens, parents, depth)
        await spin_until(pending.ready)
        return self.verifier.finish(pending)

    async def close(self) -> None:
        if self._spinner is not None:
            await self._spinner.close()
        self._pool.shutdown(wait=True)
