"""What a client asks for and what the engine streams back, free of protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from treespec.common.serving.errors import InvalidRequest

# abort: the server stopped before the request finished (it ends UNAVAILABLE)
FinishReason = Literal["length", "stop", "cancelled", "abort"]


@dataclass(frozen=True)
class GenRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    no_speculation: bool = False
    request_id: str = ""
    sampling: dict = field(default_factory=dict)   # the SamplingParams fields it set


def check_request(req: GenRequest, vocab_size: int, max_model_len: int) -> None:
    """Raise InvalidRequest, saying what is wrong, for a request no model could serve."""
    if not req.prompt_ids:
        raise InvalidRequest("the prompt is empty")
    if req.max_tokens <= 0:
        raise InvalidRequest(f"max_tokens must be > 0, got {req.max_tokens}")
    bad = [t for t in req.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab_size})")
    if len(req.prompt_ids) >= max_model_len:
        raise InvalidRequest(f"prompt of {len(req.prompt_ids)} tokens leaves no room in "
                             f"max_model_len {max_model_len}")


@dataclass
class Stats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0             # target forwards after prefill that produced tokens
    draft_tokens: int = 0      # valid draft nodes offered to the target
    accepted_tokens: int = 0   # accepted draft tokens, bonus tokens excluded
    fallback_steps: int = 0    # steps with no usable proposal while speculating
    planned_plain_steps: int = 0   # steps the speculation controller chose to run plain
    cached_tokens: int = 0     # prompt tokens whose KV came from the prefix cache


@dataclass
class StepOutput:
    """Tokens one engine iteration committed for one request."""

    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stats: Stats = field(default_factory=Stats)
    error: str | None = None      # the engine failed this request (not the client's fault)
