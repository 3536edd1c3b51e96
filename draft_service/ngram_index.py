"""Where the suffix of one token sequence recurred earlier in it.

The tokens are kept twice: as a list (for slicing continuations) and as 4-byte
words in one bytearray, where an n-gram is a 4n-byte pattern that ``rfind``
looks up in C. Appending costs a copy of the new tokens whatever n_min and n_max
are, so a long prompt is taken in at once; a lookup scans the sequence once per
n, backwards, and stops after the matches it needs.

Example, n_min = 1, n_max = 2, tokens ``[5, 6, 7, 5, 6]``: the suffix ``(5, 6)``
occurred before, ending at 2, so ``matches()`` yields continuation start 2 for
n = 2 and nothing new for n = 1 (start 2 again): the continuation is
``tokens[2:] = [7, 5, 6]``.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

WORD = 4          # bytes a token (token ids are int32 on the wire)


class NgramIndex:
    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError("need 1 <= n_min <= n_max")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._words = bytearray()

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        """Append tokens (ids in [0, 2**31))."""
        self._words += array("i", new).tobytes()
        self.tokens.extend(new)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (a lookahead's guesses are taken back)."""
        del self.tokens[n:]
        del self._words[n * WORD:]

    def matches(self, per_n: int) -> Iterator[int]:
        """Continuation starts of earlier occurrences of the sequence's suffix.

        Longer suffixes first (n_max down to n_min); within one n, the most
        recent occurrence first, at most per_n of them. A start already yielded
        for a longer n is not repeated.
        """
        end = len(self.tokens)
        words = self._words
        seen: set[int] = set()
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            pattern = words[(end - n) * WORD:]
            hi = (end - 1) * WORD            # an occurrence ends before the last token
            taken = 0
            while taken < per_n:
                at = words.rfind(pattern, 0, hi)
                if at < 0:
                    break
                hi = at + len(pattern) - 1   # the next search: strictly to the left
                if at % WORD:                # straddles two tokens: not an n-gram
                    continue
                start = at // WORD + n
                if start not in seen:
                    seen.add(start)
                    taken += 1
                    yield start
