"""`treespec openai`, the OpenAI-compatible front: the official `openai` client against a
draft, a verify (the shipped tiny-code checkpoint, given a chat template here) and the
front, all started through the CLI. Completions equal `treespec generate`'s text for
the same prompt and settings (greedy and seeded), chat goes through the template,
usage counts right, stop strings cut exactly, errors come in OpenAI's shape with their
status, 200 concurrent streams all finish and leave the verify's KV pages at 0, a
client that leaves cancels its generation, SIGTERM lets a stream finish; the app in
process over the real verify: keys and the shipped checkpoint's missing chat template
(tests/test_openai_app.py has the app over a scripted client)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

import services
from parallel_services import free_port
from prom import scrape, value
from test_openai_app import answer, check_error, shipped_tokenizer  # noqa: F401, F811 - a fixture
from treespec.common.model.paths import resolve_model
from treespec.common.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(services.servers_missing() is not None,
                                reason=str(services.servers_missing()))

KEY = "sk-treespec-test"
PROMPT = "def fibonacci(n):\n"
# ChatML with Qwen3's enable_thinking switch; the tiny checkpoint knows none of these
# as special tokens, which the test does not need
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>"
            "\n\n{% endif %}{% endif %}")
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def fibonacci(n):"}]


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory) -> Path:
    """The shipped tiny-code checkpoint with a chat template added."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny-chat"
    shutil.copytree(resolve_model("tiny-code"), path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def tokenizer(chat_checkpoint):
    return load_tokenizer(chat_checkpoint)


@pytest.fixture(scope="module")
def trio(chat_checkpoint):
    """(verify, front, the verify's metrics URL): the three processes start together;
    the verify's port is chosen up front and the front waits for it."""
    dport, vport, mport = free_port(), free_port(), free_port()
    with services.at_once(
            services.draft_argv("ngram", port=dport),
            services.verify_argv(chat_checkpoint, "--port", str(vport), "--metrics-port",
                                 str(mport), draft=f"127.0.0.1:{dport}"),
            ["openai", "--verify", f"127.0.0.1:{vport}", "--port", "0"]) as procs:
        _, verify, front = procs
        services.wait_draft_connected(verify)
        yield verify, front, f"http://127.0.0.1:{mport}/metrics"


SETTINGS = {"greedy": dict(temperature=0.0),
            "seeded": dict(temperature=0.9, top_p=0.95, top_k=40, seed=1234)}
MAX_TOKENS = 24


def chat_ids(tokenizer, thinking: bool) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=thinking)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def refs(trio, tokenizer) -> dict[str, dict]:
    """`treespec generate --json` for the same requests (run together: one import's time):
    PROMPT under each of SETTINGS, and the chat prompt (thinking off) greedy."""
    verify = trio[0]
    flags = {name: [a for k, v in s.items() for a in (f"--{k.replace('_', '-')}", str(v))]
             for name, s in SETTINGS.items()}
    calls = {name: ["--prompt", PROMPT, *f] for name, f in flags.items()}
    calls["chat"] = ["--prompt-ids", ",".join(map(str, chat_ids(tokenizer, False))),
                     *flags["greedy"]]
    procs = services.run_clis(*(["generate", "--addr", verify.addr, "--json", "--max-tokens",
                                 str(MAX_TOKENS), "--ignore-eos", *a] for a in calls.values()))
    return {name: services.parse_json(p) for name, p in zip(calls, procs)}


def url(proc) -> str:
    return f"http://{proc.addr}"


def client(proc, key: str = "unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url(proc)}/v1", api_key=key, max_retries=0, **kw)


def pages_back_to_zero(metrics_url: str, timeout: float = 10.0) -> float:
    """Seconds until the verify holds no KV page and runs no request (fails past timeout)."""
    start = time.monotonic()
    while True:
        m = scrape(metrics_url)
        if value(m, "treespec:kv_pages_used") == 0 and value(m, "vllm:num_requests_running") == 0:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, "the verify still holds pages"
        time.sleep(0.05)


def aborted(metrics_url: str) -> float:
    """Requests the verify counts as ended before their finish (cancelled)."""
    return scrape(metrics_url).get(
        ("vllm:request_success_total", frozenset({("finished_reason", "abort")})), 0.0)


def test_models_health_metrics(trio, chat_checkpoint):
    _, front, _ = trio
    assert [m.id for m in client(front).models.list()] == [str(chat_checkpoint)]
    assert httpx.get(f"{url(front)}/health").json() == {"status": "ok"}
    text = httpx.get(f"{url(front)}/metrics").text
    assert 'treespec:openai_requests_total{route="/v1/models",status="200"} 1.0' in text


def check_stats(spec: dict, completion_tokens: int) -> None:
    """The response's treespec field: the verify's statistics for the request."""
    assert 1 <= spec["steps"] <= completion_tokens - 1
    assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["tokens_per_step"] == round((completion_tokens - 1) / spec["steps"], 3)


@pytest.mark.parametrize("mode", list(SETTINGS))
def test_completion_equals_grpc_generate(trio, refs, mode):
    _, front, _ = trio
    ref, s = refs[mode], dict(SETTINGS[mode])
    c = client(front)
    top_k = s.pop("top_k", None)
    kw = dict(model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=MAX_TOKENS, **s,
              extra_body={"ignore_eos": True, **({"top_k": top_k} if top_k else {})})
    done = c.completions.create(**kw)
    assert done.choices[0].text == ref["text"] and len(ref["token_ids"]) == MAX_TOKENS
    assert done.choices[0].finish_reason == "length"
    prompt_tokens = ref["stats"]["prompt_tokens"]
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) \
        == (prompt_tokens, MAX_TOKENS, prompt_tokens + MAX_TOKENS)
    check_stats(done.model_extra["treespec"], MAX_TOKENS)   # kept by the client, unread
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True},
                                       **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert all(ch.usage is None for ch in chunks[:-1])


def test_streamed_chat_uses_the_template(trio, refs, tokenizer):
    _, front, _ = trio
    ref, ids = refs["chat"], chat_ids(tokenizer, thinking=False)
    c = client(front)
    model = c.models.list().data[0].id
    chunks = list(c.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == ref["text"] and content
    (last,) = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert last.choices[0].finish_reason == "length"
    check_stats(last.model_extra["treespec"], MAX_TOKENS)
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (len(ids), MAX_TOKENS)
    # the switch reaches the template: thinking on leaves out the empty think block
    done = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4,
                                     temperature=0, extra_body={
                                         "chat_template_kwargs": {"enable_thinking": True}})
    assert done.usage.prompt_tokens == len(chat_ids(tokenizer, thinking=True)) < len(ids)
    assert done.choices[0].message.role == "assistant"


def test_stop_strings_and_ids_cut_exactly(trio, refs, tokenizer):
    _, front, _ = trio
    text, ids = refs["greedy"]["text"], refs["greedy"]["token_ids"]
    mid = len(text) // 2
    stop = text[mid:mid + 3]
    cut = text.find(stop)
    # the tokens up to the one whose text completes the stop string
    n = next(k for k in range(1, len(ids) + 1)
             if stop in tokenizer.decode(ids[:k], skip_special_tokens=True))
    c = client(front)
    kw = dict(model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=MAX_TOKENS,
              temperature=0, stop=["never-in-this-text", stop], extra_body={"ignore_eos": True})
    done = c.completions.create(**kw)
    assert (done.choices[0].text, done.choices[0].finish_reason) == (text[:cut], "stop")
    assert done.usage.completion_tokens == n
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True},
                                       **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text[:cut]
    assert chunks[-1].usage.completion_tokens == n
    # a stop token id: the verify ends at its first occurrence, the token included
    first = next(k for k, t in enumerate(ids) if k >= 3 and ids.index(t) == k)
    done = c.completions.create(model=kw["model"], prompt=PROMPT, max_tokens=MAX_TOKENS,
                                temperature=0, extra_body={"ignore_eos": True,
                                                           "stop_token_ids": [ids[first]]})
    assert (done.choices[0].finish_reason, done.usage.completion_tokens) == ("stop", first + 1)
    assert done.choices[0].text == tokenizer.decode(ids[:first + 1], skip_special_tokens=True)


BAD = [  # (route, body, status, param)
    ("completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "seed": -3}, 400, "seed"),
    ("completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ("completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("completions", {"prompt": "x", "stop": ["a", ""]}, 400, "stop"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"max_tokens": 3}, 400, "prompt"),
    ("completions", {"prompt": [1, 99999], "max_tokens": 2}, 400, None),   # the verify's check
    ("completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, 400, "n"),
]


def test_bad_requests(trio):
    """Each refused with its status and the field named, streamed or not."""
    _, front, _ = trio
    with httpx.Client(base_url=f"{url(front)}/v1", timeout=30) as h:
        for route, body, status, param in BAD:
            for stream in (False, True):
                err = check_error(h.post(route, json={**body, "stream": stream}), status, param)
                assert err["type"] == "invalid_request_error"
                assert err["code"] == ("model_not_found" if status == 404 else None)
        check_error(h.post("completions", json={"prompt": "x", "stream_options": {
            "include_usage": True}}), 400, "stream_options")
        check_error(h.post("completions", content=b'{"prompt": ',
                           headers={"content-type": "application/json"}), 400, None)
        check_error(h.get("nothing-here"), 404, None)
    c = client(front)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="gpt-4o", prompt="x")
    with pytest.raises(openai.BadRequestError, match="one choice"):
        c.completions.create(model=c.models.list().data[0].id, prompt="x", n=2)


def test_two_hundred_concurrent_streams_all_finish(trio):
    _, front, metrics_url = trio
    n, tokens = 200, 12

    async def one(c: openai.AsyncOpenAI, model: str, i: int) -> tuple[str, str, int]:
        stream = await c.completions.create(
            model=model, prompt=f"def f{i}(x):\n", max_tokens=tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, reason, used = [], None, -1
        async for ch in stream:
            if ch.choices:
                text.append(ch.choices[0].text)
                reason = ch.choices[0].finish_reason or reason
            if ch.usage is not None:
                used = ch.usage.completion_tokens
        return "".join(text), reason, used

    async def all_of_them() -> list:
        async with openai.AsyncOpenAI(base_url=f"{url(front)}/v1", api_key="x",
                                      max_retries=0, timeout=120) as c:
            model = (await c.models.list()).data[0].id
            return await asyncio.gather(*(one(c, model, i) for i in range(n)))

    outs = asyncio.run(all_of_them())
    assert len(outs) == n and all(r == "length" and u == tokens for _, r, u in outs), outs
    assert pages_back_to_zero(metrics_url) < 10
    m = scrape(f"{url(front)}/metrics")
    assert value(m, "treespec:openai_requests_total", route="/v1/completions",
                 status="200") >= n
    assert value(m, "treespec:openai_requests_running") == 0


def test_a_client_that_leaves_cancels_its_generation(trio):
    """Mid-stream and while a whole completion is computed: a long generation (2000
    tokens, tens of seconds here) ends within seconds of the client leaving."""
    _, front, metrics_url = trio
    body = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    before = aborted(metrics_url)
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", f"{url(front)}/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            events = [next(lines) for _ in range(6)]
            assert all(e.startswith("data: {") for e in events if e)
        # the response and its connection are closed here
    assert pages_back_to_zero(metrics_url) < 5
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url(front)}/v1/completions", json=body, timeout=1.0)
    assert pages_back_to_zero(metrics_url) < 5
    assert aborted(metrics_url) - before == 2


def test_keys_and_a_checkpoint_without_a_chat_template(trio, shipped_tokenizer):
    """A front with keys, on the shipped checkpoint: 401 without a right key; chat is
    refused for the missing template, completions work (the real verify behind it)."""
    verify = trio[0].addr
    keyed = dict(api_keys=(KEY.encode(),), served_model_name="tiny")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        err = check_error(answer(verify, body, shipped_tokenizer, headers=headers, **keyed),
                          401, None)
        assert err["code"] == "invalid_api_key"
    auth = {"Authorization": f"Bearer {KEY}"}
    r = answer(verify, body, shipped_tokenizer, headers=auth, **keyed)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    err = check_error(answer(verify, {"model": "tiny", "messages": MESSAGES},
                             shipped_tokenizer, route="chat/completions", headers=auth,
                             **keyed), 400, "messages")
    assert "no chat template" in err["message"]
    err = check_error(answer(verify, {**body, "model": "tiny-code"}, shipped_tokenizer,
                             headers=auth, **keyed), 404, "model")
    assert "'tiny'" in err["message"]


def test_sigterm_lets_a_running_stream_finish_then_exits_0(trio):
    """Runs last: it stops the front."""
    _, front, _ = trio
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        with httpx.stream("POST", f"{url(front)}/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 100, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            for ln in r.iter_lines():
                if ln:
                    lines.append(ln)
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(30)
    assert front.stop(grace=30) == 0
    reader.join(30)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
