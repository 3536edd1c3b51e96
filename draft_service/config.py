"""Draft service configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.service_config import ServiceConfig
from common.tree import TreeEnvelope

Method = Literal["ngram", "model", "eagle3"]
METHODS: tuple[str, ...] = ("ngram", "model", "eagle3")


@dataclass(frozen=True, kw_only=True)
class DraftConfig(ServiceConfig):
    method: Method
    envelope: TreeEnvelope
    model: str | None = None          # checkpoint dir (or shipped name) for model/eagle3
    target_embeddings: str | None = None  # eagle3 without embed_tokens: target ckpt / safetensors
    num_blocks: int = 2048            # draft KV pages
    ngram_max: int = 4                # longest suffix the n-gram proposer matches
    ngram_min: int = 1
    max_sequences: int = 256          # sequences whose state the draft keeps

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.method not in METHODS:
            raise ValueError(f"unknown draft method {self.method!r}; expected one of {METHODS}")
        if self.method in ("model", "eagle3") and not self.model:
            raise ValueError(f"--method {self.method} needs --model")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.max_sequences < 1:
            raise ValueError("max_sequences must be >= 1")
