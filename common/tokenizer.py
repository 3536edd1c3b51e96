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
    """Turns a growing list of token ids into text deltas.

    Decodes the whole completion each time and emits what is new, holding back a
    trailing replacement character (an unfinished UTF-8 sequence).
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.sent = 0

    def push(self, ids: list[int], final: bool = False) -> str:
        if self.tok is None:
            return ""
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        end = len(text) if final or not text.endswith("\ufffd") else len(text) - 1
        delta = text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta
