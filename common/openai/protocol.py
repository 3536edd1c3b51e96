"""The OpenAI request bodies the front accepts and the objects it answers with.

Requests are pydantic models: types and ranges are checked here (a violation is a 400
naming the field, see ``errors.py``); what this front cannot do (n > 1, logprobs,
penalties, tools) is refused in ``translate.py``. Fields OpenAI does not define and
this front does not know are ignored, as vLLM does. Extensions beside OpenAI's
fields, as vLLM names them: ``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos``,
``chat_template_kwargs``, ``add_generation_prompt``.

Responses are plain dicts. Every completion (and a stream's last choice chunk)
carries ``treespec``: the verify's speculation statistics for the request (steps,
draft_tokens, accepted_tokens, fallback_steps, tokens_per_step), an extension field
OpenAI's clients keep but ignore.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_STRINGS = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """The fields chat and completions share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None                   # None: the one model this front serves
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)   # None: the checkpoint's default
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)          # -1 or 0: every token
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=1 << 64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")     # name, tool_calls, ...: to the template

    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)        # OpenAI's default for completions


Kind = Literal["chat", "completion"]
_OBJECT = {"chat": ("chat.completion", "chat.completion.chunk"),
           "completion": ("text_completion", "text_completion")}


class ResponseShape:
    """One request's response objects: the whole completion, or its stream's chunks."""

    def __init__(self, kind: Kind, model: str) -> None:
        self.kind = kind
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def completion(self, text: str, finish_reason: str, usage: dict,
                   stats: dict | None) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason,
                                  "logprobs": None}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._envelope(_OBJECT[self.kind][0], [choice]), "usage": usage,
                "treespec": stats}

    def chunk(self, text: str | None, finish_reason: str | None = None,
              first: bool = False, stats: dict | None = None,
              with_usage: bool = False) -> dict:
        """A stream's choice chunk (text None: no content, as a chat stream's last)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason,
                                  "logprobs": None}
        if self.kind == "chat":
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        out = self._envelope(_OBJECT[self.kind][1], [choice])
        if with_usage:
            out["usage"] = None
        if stats is not None:
            out["treespec"] = stats
        return out

    def usage_chunk(self, usage: dict) -> dict:
        """stream_options.include_usage: the last chunk, no choices."""
        return {**self._envelope(_OBJECT[self.kind][1], []), "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int, stats: dict | None = None) -> dict:
    """OpenAI's usage; stats (the verify's, when it finished the request) say how many
    prompt tokens came from the prefix cache."""
    cached = (stats or {}).get("cached_tokens", 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def model_list(name: str, owned_by: str = "treespec") -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": owned_by}]}
