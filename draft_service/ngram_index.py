"""An incremental index from n-grams to where they recur in one token sequence.

For every n in [n_min, n_max] and every position, the index maps the n tokens
ending there to the *continuation start* right after them. Appending a token
costs O(n_max); a lookup touches only the positions that matched.

Example, n_min = 1, n_max = 2, tokens ``[5, 6, 7, 5, 6]``::

    (5, 6) -> [2, 5]    (6,) -> [2, 5]    (5,) -> [1, 4]    (7,) -> [3]   (6, 7) -> [3] ...

The suffix ``(5, 6)`` ends the sequence (start 5, which has no continuation), so
``matches()`` yields start 2 for n = 2 and nothing new for n = 1 (start 2 again):
the continuation is ``tokens[2:] = [7, 5, 6]``.
"""

from __future__ import annotations

from collections.abc import Iterator


class NgramIndex:
    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError("need 1 <= n_min <= n_max")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._starts: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        """Append tokens and index every n-gram that ends at one of them."""
        toks = self.tokens
        for t in new:
            toks.append(t)
            end = len(toks)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._starts.setdefault(tuple(toks[end - n:end]), []).append(end)

    def matches(self, per_n: int) -> Iterator[int]:
        """Continuation starts of earlier occurrences of the sequence's suffix.

        Longer suffixes first (n_max down to n_min); within one n, the most
        recent occurrence first, at most per_n of them. A start already yielded
        for a longer n is not repeated.
        """
        end = len(self.tokens)
        seen: set[int] = set()
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            starts = self._starts.get(tuple(self.tokens[end - n:]), ())
            taken = 0
            for s in reversed(starts):
                if taken == per_n:
                    break
                if s >= end or s in seen:
                    continue
                seen.add(s)
                taken += 1
                yield s
