"""Streaming detokenization with the shipped byte-level BPE tokenizer: the deltas join
up to the tokenizer's decode of the whole completion, whatever the chunking (multi-byte
characters split across tokens and steps included), and each push decodes a window that
does not grow with the completion."""

from __future__ import annotations

import random

import pytest

from treespec.common.model.paths import resolve_model
from treespec.common.model.tokenizer import Detokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    t = load_tokenizer(resolve_model("tiny-code"))
    assert t is not None
    return t


class Spy:
    """The tokenizer, recording the longest id list it was asked to decode."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.longest = 0

    def decode(self, ids, **kw):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, **kw)


def _stream(tok, ids: list[int], rng: random.Random) -> tuple[str, int]:
    spy = Spy(tok)
    d = Detokenizer(spy)
    out, at = [], 0
    while at < len(ids):
        n = rng.randint(1, 5)                      # 1..depth+1 tokens a step
        chunk, at = ids[at:at + n], at + n
        out.append(d.push(chunk, final=at >= len(ids)))
    return "".join(out), spy.longest


@pytest.mark.parametrize("seed", range(6))
def test_deltas_join_up_to_the_whole_decode(tok, seed):
    rng = random.Random(seed)
    text = "def f(x):\n    return x * 2  # naïve ☃ 日本語 🚀\n" * 3
    cases = [tok.encode(text),                                    # real text
             [rng.randrange(tok.vocab_size) for _ in range(300)]]  # gibberish, bad UTF-8
    for ids in cases:
        got, _ = _stream(tok, ids, rng)
        assert got == tok.decode(ids, skip_special_tokens=True)


def test_each_push_decodes_a_bounded_window(tok):
    ids = tok.encode("for i in range(10):\n    print(i, 'é', '✓')\n" * 40)
    assert len(ids) > 400
    got, longest = _stream(tok, ids, random.Random(0))
    assert got == tok.decode(ids, skip_special_tokens=True)
    assert longest <= 20, f"a push decoded {longest} ids"


def test_without_a_tokenizer_there_is_no_text():
    assert Detokenizer(None).push([1, 2, 3], final=True) == ""
