"""One running request inside the verify engine: its committed tokens, KV pages,
stats and output queue."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from treespec.common.runtime.kv_cache import SeqPages
from treespec.common.spec.sampling import GREEDY, SamplingParams
from treespec.verify_service.request import FinishReason, GenRequest, Stats, StepOutput

if TYPE_CHECKING:
    from treespec.common.runtime.row_buffer import RowBuffer

_ids = itertools.count(1)


@dataclass
class Sequence:
    req: GenRequest
    stop_ids: frozenset[int]                  # request stop ids + EOS unless ignored
    max_len: int                              # prompt + completion cap
    sampling: SamplingParams = GREEDY         # resolved: defaults filled in, a seed drawn
    seq_id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)   # committed, prompt included
    pages: SeqPages = field(default_factory=SeqPages)
    stats: Stats = field(default_factory=Stats)
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    finish: FinishReason | None = None
    cancelled: bool = False
    aborted: bool = False             # cut by the server's stop, not by its client
    error: str | None = None          # set when the engine failed this sequence
    accepted_path: list[int] = field(default_factory=list)  # nodes of its last tree
    # Target hidden states [kv_len - hidden_from, C] of every token whose KV is written
    # from hidden_from on (a reused cached prefix has none), kept on the device while a
    # drafter reads them (EAGLE-3, DFlash); None otherwise.
    hidden: "RowBuffer | None" = None
    hidden_from: int = 0

    def __post_init__(self) -> None:
        self.tokens = list(self.req.prompt_ids)
        self.stats.prompt_tokens = len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.stats.prompt_tokens

    @property
    def prefilling(self) -> bool:
        """Part of its prompt's KV is not written yet (the engine prefills in chunks)."""
        return self.pages.kv_len < self.stats.prompt_tokens

    @property
    def speculative(self) -> bool:
        return not self.req.no_speculation

    def commit(self, new: list[int]) -> list[int]:
        """Append tokens up to the first stop condition; returns those kept."""
        kept: list[int] = []
        for t in new:
            if self.finish is not None:
                break
            kept.append(t)
            if t in self.stop_ids:
                self.finish = "stop"
            elif self.num_generated + len(kept) >= self.req.max_tokens or \
                    len(self.tokens) + len(kept) >= self.max_len:
                self.finish = "length"
        self.tokens.extend(kept)
        self.stats.completion_tokens += len(kept)
        return kept

    def emit(self, kept: list[int]) -> None:
        stats = Stats(**vars(self.stats)) if self.finish else self.stats
        self.out.put_nowait(StepOutput(kept, self.finish, stats, self.error))
