"""The corpus (the running interpreter's standard library), its held-out split, the
byte-level BPE tokenizer, and token windows.

Documents are whole .py files in sorted relative-path order, each followed by
`<|endoftext|>` (id 0, the EOS and document separator).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"

# Fixed evaluation files: present, by these names, in CPython 3.11, 3.12 and 3.13.
HELD_OUT: tuple[str, ...] = (
    "base64.py", "bisect.py", "calendar.py", "colorsys.py", "contextlib.py", "csv.py",
    "fnmatch.py", "fractions.py", "glob.py", "graphlib.py", "heapq.py", "html/parser.py",
    "json/decoder.py", "json/encoder.py", "pprint.py", "queue.py", "sched.py", "shlex.py",
    "string.py", "textwrap.py",
)

# Any path component named so marks test code or third-party code.
_SKIP_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                         "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    root: Path
    train_files: tuple[str, ...]     # relative paths, sorted
    held_out_files: tuple[str, ...]
    train_texts: tuple[str, ...]
    held_out_texts: tuple[str, ...]

    def stats(self) -> dict:
        return {"stdlib": str(self.root), "train_files": len(self.train_files),
                "held_out_files": len(self.held_out_files),
                "train_bytes": sum(len(t.encode()) for t in self.train_texts),
                "held_out_bytes": sum(len(t.encode()) for t in self.held_out_texts)}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path) -> list[str]:
    """Relative paths of the stdlib's .py files outside test and third-party dirs, sorted."""
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if _SKIP_PARTS.isdisjoint(rel.parts[:-1]) and p.is_file():
            out.append(rel.as_posix())
    return sorted(out)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def load_corpus(max_files: int | None = None, root: Path | None = None) -> Corpus:
    """Training files are every listed source but the held-out ones; max_files keeps an
    evenly spaced, deterministic subset of them."""
    root = root or stdlib_root()
    files = list_sources(root)
    missing = [f for f in HELD_OUT if f not in files]
    if missing:
        raise FileNotFoundError(f"held-out files missing from {root}: {missing}")
    train = [f for f in files if f not in HELD_OUT]
    if max_files is not None and max_files < len(train):
        step = len(train) / max_files
        train = [train[int(i * step)] for i in range(max_files)]
    pairs = [(f, _read(root / f)) for f in train]
    pairs = [(f, t) for f, t in pairs if t]
    held = [(f, _read(root / f)) for f in HELD_OUT]
    return Corpus(root, tuple(f for f, _ in pairs), tuple(f for f, _ in held),
                  tuple(t for _, t in pairs), tuple(t or "" for _, t in held))


def train_tokenizer(texts: tuple[str, ...], vocab_size: int,
                    max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 pre-tokenizer regex, all 256 bytes in the alphabet, no
    prefix space), special token EOS at id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.token_to_id(EOS) != 0:
        raise RuntimeError("EOS must be token 0")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   model_max_length=max_length, clean_up_tokenization_spaces=False)


def tokenizer_digest(tok: PreTrainedTokenizerFast) -> str:
    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()[:16]


def encode_stream(tok: PreTrainedTokenizerFast, texts: tuple[str, ...]) -> torch.Tensor:
    """All documents, each followed by EOS, as one int64 stream."""
    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


class WindowSampler:
    """Random windows [batch, length] of a token stream, from a seeded CPU generator
    (the same batches on every device)."""

    def __init__(self, stream: torch.Tensor, length: int, seed: int,
                 starts: torch.Tensor | None = None) -> None:
        if len(stream) <= length:
            raise ValueError(f"stream of {len(stream)} tokens is too short for {length}")
        self.stream, self.length = stream, length
        self.starts = starts            # where a window may begin (None: anywhere)
        self.gen = torch.Generator().manual_seed(seed)

    def sample(self, batch: int) -> torch.Tensor:
        if self.starts is None:
            starts = torch.randint(0, len(self.stream) - self.length, (batch,), generator=self.gen)
        else:
            starts = self.starts[torch.randint(0, len(self.starts), (batch,), generator=self.gen)]
        return torch.stack([self.stream[s:s + self.length] for s in starts.tolist()])


def file_starts(stream: torch.Tensor, eos: int, length: int, spread: int) -> torch.Tensor:
    """Window starts within `spread` tokens of a document's first token (documents end
    in eos, as encode_stream writes them) whose `length` tokens fit in the stream."""
    firsts = torch.cat([torch.zeros(1, dtype=torch.long), (stream == eos).nonzero()[:, 0] + 1])
    out = (firsts[:, None] + torch.arange(spread + 1)).flatten()
    return out[out + length <= len(stream)]


def fixed_windows(stream: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """Up to count evenly spaced, non-overlapping windows [n, length] (for evaluation)."""
    n = min(count, len(stream) // length)
    if n == 0:
        raise ValueError("stream shorter than one window")
    stride = len(stream) // n
    return torch.stack([stream[i * stride:i * stride + length] for i in range(n)])


def draft_vocab(stream: torch.Tensor, vocab_size: int,
                draft_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft_size most frequent target tokens (ties: lower id), as ascending ids
    [draft_size], with d2t int64 [draft_size] (target = draft + d2t[draft]) and
    t2d bool [vocab_size]."""
    counts = torch.bincount(stream, minlength=vocab_size).double()
    # Stable descending sort: equal counts keep ascending id order.
    order = torch.sort(-counts, stable=True).indices[:draft_size]
    ids = torch.sort(order).values
    d2t = ids - torch.arange(draft_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids, d2t, t2d
