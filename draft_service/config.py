"""Draft service configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from treespec.common.wire import frames
from treespec.common.serving.config import ServiceConfig
from treespec.common.spec.tree import TreeEnvelope

# draft method -> whether it loads a checkpoint (--model); registry.py maps each to its
# proposer class
METHODS: dict[str, bool] = {"ngram": False, "model": True, "eagle3": True, "dflash": True}


# lookahead candidates a sequence may have: each costs a draft step while the target verifies
MAX_LOOKAHEAD = 8


@dataclass(frozen=True, kw_only=True)
class DraftConfig(ServiceConfig):
    method: str                       # a METHODS name
    envelope: TreeEnvelope
    model: str | None = None          # checkpoint dir (or shipped name) for model/eagle3
    target_embeddings: str | None = None  # eagle3 without embed_tokens: target ckpt / safetensors
    num_blocks: int = 4096            # draft KV pages: as many as the verify's default
    ngram_max: int = 4                # longest suffix the n-gram proposer matches
    ngram_min: int = 1
    max_sequences: int = 256          # sequences whose state the draft keeps
    max_model_len: int = 131072       # committed tokens a sequence may have
    # how a model drafter drafts a sampling request: sample (with the request's seeded
    # noise, as its acceptance needs) or deterministic (top-k by log-prob)
    draft_sampling: str = "sample"
    # candidate trees pre-drafted per sequence for the step after each one, while the
    # verify service runs it (draft_service/lookahead.py); 0: none
    lookahead: int = 0
    # also serve Speculate on a Unix socket for a verify service on this host: auto
    # (an abstract socket named after the instance, on Linux; reachable only inside
    # this network namespace, so other hosts and containers keep gRPC), off, or a
    # path / @name
    local_socket: str = "auto"
    local_socket_uids: tuple[int, ...] = ()   # users besides this one the socket admits

    def local_address(self, instance_id: str) -> str | None:
        """Where to serve the local socket, None for nowhere."""
        if self.local_socket == "off":
            return None
        if self.local_socket == "auto":
            return frames.auto_address(instance_id)
        return self.local_socket

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.method not in METHODS:
            raise ValueError(f"unknown draft method {self.method!r}; expected one of "
                             f"{tuple(METHODS)}")
        if METHODS[self.method] and not self.model:
            raise ValueError(f"--method {self.method} needs --model")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.draft_sampling not in ("sample", "deterministic"):
            raise ValueError("--draft-sampling wants sample or deterministic, got "
                             f"{self.draft_sampling!r}")
        if not 0 <= self.lookahead <= MAX_LOOKAHEAD:
            raise ValueError(f"--lookahead wants 0 .. {MAX_LOOKAHEAD}, got {self.lookahead}")
        if self.max_sequences < 1 or self.max_model_len < 1:
            raise ValueError("--max-sequences and --max-model-len must be >= 1")
        if self.local_socket in ("", "@"):
            raise ValueError("--local-socket wants auto, off, a socket path or @name, "
                             f"got {self.local_socket!r}")
