"""The checkpoint's tokenizer, when it has one, and streaming detokenization."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("treespec.tokenizer")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path) -> Any | None:
    """AutoTokenizer from the checkpoint directory, or None if it ships none."""
    path = Path(path)
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


class Detokenizer:
    """Turns a growing list of token ids into text deltas, in time that does not grow
    with the completion: each push decodes only the tokens since the last character
    boundary it emitted up to, with the tokens of the delta before in front for context
    (a SentencePiece decoder drops a window's leading space). Decoding the whole
    completion on every step would cost a long request more per step the longer it
    runs, on the verify service's event loop.

    A trailing replacement character (an unfinished UTF-8 sequence) is held back until
    later tokens complete it or the stream ends (``final``); the text before it goes
    out at once. The deltas join up to the tokenizer's decode of the whole list when
    decoding is concatenative at character boundaries (byte-level BPE without clean-up
    of tokenization spaces, as Qwen's; SentencePiece).
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0       # ids[prefix:read]: context, already sent
        self.read = 0         # ids[:read] are sent; read sits on a character boundary
        self.extra = 0        # characters sent past ids[:read] (before a held-back one)

    def push(self, ids: list[int], final: bool = False) -> str:
        if self.tok is None:
            return ""
        self.ids.extend(ids)
        sent = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        text = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        pending = text.endswith("\ufffd") and not final
        start = len(sent) + self.extra
        delta = text[start:len(text) - 1 if pending else len(text)]
        if pending:
            self.extra += len(delta)
        else:
            self.prefix, self.read, self.extra = self.read, len(self.ids), 0
        return delta
