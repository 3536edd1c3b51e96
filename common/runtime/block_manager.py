"""Ref-counted KV pages: a free list and per-page reference counts."""

from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class BlockManager:
    """Hands out page ids in [0, num_blocks). Pages return when their count hits 0."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"page {b} is not allocated")
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"page {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
