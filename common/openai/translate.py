"""An OpenAI request as a Generate call: its prompt token ids and the call's arguments.

Prompts are tokenized here, with the checkpoint's tokenizer: a chat's messages go
through its chat template (``apply_chat_template`` to text, ``chat_template_kwargs``
such as Qwen3's ``enable_thinking`` passed on, then encoded without special tokens:
the template writes them), a completion's text through ``encode`` as the verify
would. Sending ids makes ``usage.prompt_tokens`` known even when a stop string ends
the stream early.

Sampling fields a request leaves unset are not sent: the verify applies the
checkpoint's generation_config.json. ``top_k`` -1 (vLLM's "all") is sent as 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treespec.common.openai.errors import APIError, bad_request
from treespec.common.openai.protocol import (MAX_STOP_STRINGS, ChatRequest, CompletionRequest,
                                             GenerationRequest)

# fields this front cannot honour, and the values that ask for nothing
_NEUTRAL: dict[str, tuple] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "tools": (None, []), "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}


@dataclass(frozen=True)
class Plan:
    """What one request asks the verify for."""

    prompt_ids: list[int]
    args: dict[str, Any]          # GenerateArgs for AsyncTreespecClient.generate_stream
    stops: tuple[str, ...]        # stop strings, cut in the front (stream.py)


def check_supported(req: GenerationRequest) -> None:
    """400 for what the verify cannot do: several choices, logprobs, penalties, tools."""
    if req.n not in (None, 1):
        raise bad_request("n", f"n = {req.n}: this server returns one choice a request "
                               "(n = 1); send n requests instead")
    for name, value in (req.model_extra or {}).items():
        if name in _NEUTRAL and value not in _NEUTRAL[name]:
            raise bad_request(name, f"{name} is not supported by this server")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options", "stream_options needs stream = true")


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(f"{where}.content[{i}]",
                              f"content parts of type {part.type!r} are not supported "
                              "(text only)")
        parts.append(part.text)
    return "".join(parts)


def chat_prompt(tokenizer: Any | None, req: ChatRequest, checkpoint: str) -> list[int]:
    """The messages through the checkpoint's chat template, as token ids."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        what = "tokenizer" if tokenizer is None else "chat template"
        raise bad_request("messages", f"the checkpoint {checkpoint} has no {what} "
                          "(tokenizer_config.json sets no chat_template), so chat requests "
                          "cannot be rendered; use /v1/completions")
    messages = []
    for i, m in enumerate(req.messages):
        d = m.model_dump(exclude_none=True)
        d["content"] = _text(m.content, f"messages[{i}]") or ""
        messages.append(d)
    kwargs = dict(req.chat_template_kwargs or {})
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt,
                                             **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja's errors (raise_exception, bad roles)
        raise bad_request("messages", f"the chat template refused the messages: "
                          f"{type(e).__name__}: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def completion_prompt(tokenizer: Any | None, req: CompletionRequest) -> list[int]:
    """The one prompt, text or token ids, as token ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request("prompt", f"{len(prompt)} prompts: this server takes one "
                                        "prompt a request")
        prompt = prompt[0]
    if isinstance(prompt, list):
        return list(prompt)
    if tokenizer is None:
        raise bad_request("prompt", "this checkpoint has no tokenizer: send token ids")
    return tokenizer.encode(prompt)


def stop_strings(req: GenerationRequest, tokenizer: Any | None) -> tuple[str, ...]:
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request("stop", f"{len(stops)} stop strings, at most {MAX_STOP_STRINGS}")
    if any(not s for s in stops):
        raise bad_request("stop", "a stop string is empty")
    if stops and tokenizer is None:
        raise bad_request("stop", "stop strings need the checkpoint's tokenizer, which it "
                                  "lacks: use stop_token_ids")
    return stops


def plan(req: GenerationRequest, prompt_ids: list[int], tokenizer: Any | None,
         max_model_len: int) -> Plan:
    """The Generate call for req, whose prompt is prompt_ids."""
    limit = getattr(req, "max_completion_tokens", None) or req.max_tokens
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens, which leaves no room "
                            f"in the model's context of {max_model_len}", param="messages"
                       if isinstance(req, ChatRequest) else "prompt")
    sampling = dict(temperature=req.temperature, top_p=req.top_p,
                    top_k=0 if req.top_k == -1 else req.top_k, min_p=req.min_p, seed=req.seed)
    args = dict(max_tokens=min(limit, room) if limit else room,
                stop_token_ids=list(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                **{k: v for k, v in sampling.items() if v is not None})
    return Plan(prompt_ids, args, stop_strings(req, tokenizer))
