"""Draft service configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.tree import TreeEnvelope

Method = Literal["ngram", "model", "eagle3"]
METHODS: tuple[str, ...] = ("ngram", "model", "eagle3")


@dataclass(frozen=True)
class DraftConfig:
    method: Method
    envelope: TreeEnvelope
    model: str | None = None          # checkpoint dir (or shipped name) for model/eagle3
    target_embeddings: str | None = None  # eagle3 without embed_tokens: target ckpt / safetensors
    host: str = "127.0.0.1"
    port: int = 0                     # 0 picks a free port
    metrics_port: int | None = None   # /metrics: None = off, 0 = a free port
    device: str = "auto"
    dtype: str = "auto"
    kernels: str = "auto"             # auto | reference | triton
    num_blocks: int = 2048            # draft KV pages
    block_size: int = 16
    ngram_max: int = 4                # longest suffix the n-gram proposer matches
    ngram_min: int = 1
    max_sequences: int = 256          # sequences whose state the draft keeps

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown draft method {self.method!r}; expected one of {METHODS}")
        if self.method in ("model", "eagle3") and not self.model:
            raise ValueError(f"--method {self.method} needs --model")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics port {self.metrics_port} out of range")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if self.max_sequences < 1:
            raise ValueError("max_sequences must be >= 1")
