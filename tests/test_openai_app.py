"""The OpenAI-compatible front's app in this process, over a scripted Generation client:
the verify statuses a test cannot provoke cheaply map to their HTTP statuses (streamed
or not), an error mid-stream is an error event then [DONE], and a stop string inside a
multi-token chunk counts only the tokens before it. tests/test_openai.py drives the
front as a process, and uses answer() here against the real verify."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from treespec.common.client import AsyncTreespecClient, Chunk, ServerInfo, TreespecError
from treespec.common.model.paths import resolve_model
from treespec.common.model.tokenizer import load_tokenizer
from treespec.common.openai.app import Gateway, build_app


@pytest.fixture(scope="module")
def shipped_tokenizer():
    """The shipped tiny-code checkpoint's: no chat template."""
    return load_tokenizer(resolve_model("tiny-code"))


def check_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    return err


class Scripted:
    """A Generation client whose stream is given: chunks, then an error or nothing."""

    def __init__(self, chunks: list[Chunk], error: grpc.StatusCode | None = None) -> None:
        self.chunks = chunks
        self.error = error
        self.closed = False

    async def generate_stream(self, prompt=None, **kw) -> AsyncIterator[Chunk]:
        try:
            for c in self.chunks:
                yield c
            if self.error is not None:
                raise TreespecError(self.error, "scripted")
        finally:
            self.closed = True

    async def wait_ready(self, timeout: float = 30.0, service: str = "") -> None:
        if self.error is not None:
            raise TimeoutError("scripted")


INFO = ServerInfo(model="tiny-code", vocab_size=6144, eos_token_ids=[0], max_model_len=2048,
                  draft_connected=True, proposer="ngram", has_tokenizer=True, envelope=None)
STATS = dict(steps=2, draft_tokens=8, accepted_tokens=3, fallback_steps=0, prompt_tokens=2,
             completion_tokens=6)


def answer(gen, body: dict, tokenizer=None, route: str = "completions",
           headers: dict | None = None, **gateway) -> httpx.Response:
    """One request to a front in this process, over gen (Scripted, or the real verify
    when gen is its address); gateway: Gateway fields (api_keys, served_model_name)."""
    async def go() -> httpx.Response:
        backend = AsyncTreespecClient(gen) if isinstance(gen, str) else gen
        info = await backend.info() if isinstance(gen, str) else INFO
        app = build_app(Gateway(backend, info, tokenizer, "tiny-code",
                                **{"served_model_name": "tiny-code", **gateway}))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://front") as h:
                return await h.post(f"/v1/{route}", json=body, headers=headers or {})
        finally:
            if isinstance(gen, str):
                await backend.close()
    return asyncio.run(go())


@pytest.mark.parametrize("code,status,error_code", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_exceeded"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
    (grpc.StatusCode.INVALID_ARGUMENT, 400, None),
    (grpc.StatusCode.INTERNAL, 500, None)])
def test_verify_status_maps_to_http(code, status, error_code):
    for stream in (False, True):
        gen = Scripted([], code)
        r = answer(gen, {"prompt": [1, 2], "stream": stream})
        err = check_error(r, status, None)
        assert err["code"] == error_code and "scripted" in err["message"]
        assert gen.closed


def test_an_error_mid_stream_is_an_error_event_then_done():
    gen = Scripted([Chunk([5], "a"), Chunk([6], "b")], grpc.StatusCode.UNAVAILABLE)
    r = answer(gen, {"prompt": [1, 2], "stream": True})
    assert r.status_code == 200
    events = [ln[len("data: "):] for ln in r.text.splitlines() if ln]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
    assert json.loads(events[2])["error"]["code"] == "service_unavailable"
    assert events[3] == "[DONE]"


def test_a_stop_string_across_chunks_counts_the_tokens_before_it(shipped_tokenizer):
    tokenizer = shipped_tokenizer
    """Speculation commits several tokens a step: the stop string's last token sits
    inside a chunk, and the tokens after it in that chunk are not counted."""
    ids = tokenizer.encode("x = 1\nreturn x\n\ny = 2")
    text = tokenizer.decode(ids)
    k = len(ids) // 2
    chunks = [Chunk(ids[:2], ""), Chunk(ids[2:k], ""), Chunk(ids[k:], "",
              finish_reason="length", stats={**STATS, "completion_tokens": len(ids)})]
    for stop in ("return", "\n\n", "= 2", "x = 1"):
        n = next(i for i in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:i]))
        for stream in (False, True):
            r = answer(Scripted(chunks), {"prompt": [1], "stop": stop, "stream": stream,
                                          "stream_options": {"include_usage": True}}
                       if stream else {"prompt": [1], "stop": stop}, tokenizer)
            if stream:
                events = [json.loads(ln[6:]) for ln in r.text.splitlines()
                          if ln.startswith("data: {")]
                got = "".join(e["choices"][0]["text"] for e in events if e["choices"])
                used = events[-1]["usage"]["completion_tokens"]
            else:
                got = r.json()["choices"][0]["text"]
                used = r.json()["usage"]["completion_tokens"]
            assert (got, used) == (text[:text.find(stop)], n), (stop, stream)
