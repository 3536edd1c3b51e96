"""One generation as text deltas, cut at the request's stop strings.

The verify streams one chunk a step (token ids and their text). Without stop strings
the deltas are the verify's own text. With them the front detokenizes token by token
(``Detokenizer``, so each delta is known with the token that made it), holds back
the longest tail of its text that begins a stop string, and at the
first token whose text completes a stop string it sends the text before that string
and ends the stream, which cancels the verify's call (its KV pages are freed). So
``finish_reason`` is "stop", ``completion_tokens`` counts the tokens up to and with
that one, and the stop string itself is not sent (as OpenAI and vLLM).

Worked example, stops ("\\n\\n",), one token a step: "a" -> delta "a"; "\\n" -> ""
(held back: it begins the stop string); "\\nb" -> the held "\\n\\nb" holds the stop
string at offset 0: the last delta is "", and the completion is "a", 3 tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc

from treespec.common.client import Chunk, TreespecError, tokens_per_step
from treespec.common.model.tokenizer import Detokenizer


@dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: str | None = None   # set on the last delta only
    completion_tokens: int = 0         # on the last: the tokens the completion holds
    stats: dict | None = None          # on the last: speculation statistics, when the
                                       # verify finished the request (not at a stop string)


class StopCutter:
    """Text of a token stream up to the first of its stop strings."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.detok = Detokenizer(tokenizer)
        self.stops = stops
        self.hold = max(map(len, stops)) - 1
        self.pending = ""            # decoded, not yet sent
        self.tokens = 0              # tokens pushed
        self.stopped = False

    def push(self, ids: list[int], final: bool) -> str:
        """The text that can go out after these tokens; sets `stopped` at a stop string
        (the tokens after the one that completed it are not counted)."""
        for i, t in enumerate(ids):
            self.pending += self.detok.push([t], final=final and i == len(ids) - 1)
            self.tokens += 1
            hits = [k for k in (self.pending.find(s) for s in self.stops) if k >= 0]
            if hits:
                self.stopped = True
                return self._take(min(hits))
        return self._take(len(self.pending) if final else self._safe())

    def _safe(self) -> int:
        """How many pending characters cannot be the start of a stop string."""
        for k in range(min(self.hold, len(self.pending)), 0, -1):
            tail = self.pending[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return len(self.pending) - k
        return len(self.pending)

    def _take(self, n: int) -> str:
        if n <= 0:
            return ""
        out, self.pending = self.pending[:n], self.pending[n:]
        return out


def speculation(stats: dict[str, int]) -> dict:
    """The verify's statistics as the response's ``treespec`` field."""
    out = {k: v for k, v in stats.items() if k not in ("prompt_tokens", "completion_tokens")}
    out["tokens_per_step"] = round(tokens_per_step(stats), 3)
    return out


async def deltas(chunks: AsyncIterator[Chunk], tokenizer: Any | None,
                 stops: tuple[str, ...]) -> AsyncIterator[Delta]:
    """Non-empty text deltas, then one last delta with finish_reason. Leaving early
    (a stop string, or the caller closing this generator) closes `chunks`, which
    cancels the call."""
    cut = StopCutter(tokenizer, stops) if stops else None
    async with aclosing(chunks):
        async for c in chunks:
            final = c.finish_reason is not None
            text = c.text if cut is None else cut.push(c.token_ids, final)
            if cut is not None and cut.stopped:
                yield Delta(text, "stop", cut.tokens)
                return
            if final:
                assert c.stats is not None
                yield Delta(text, c.finish_reason, c.stats["completion_tokens"],
                            speculation(c.stats))
                return
            if text:
                yield Delta(text)
    raise TreespecError(grpc.StatusCode.INTERNAL, "the stream ended without a finish_reason")
