"""common/client/sdk.py against an in-process fake Generation server, sync and asyncio."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

from treespec.common.client import (AsyncTreespecClient, Completion, TreespecClient, TreespecError,
                           build_request)
from fake_generation import FakeGeneration, FakeServer

STEPS = [[1, 2, 3], [4], [5, 6]]


@pytest.fixture
def fake() -> FakeGeneration:
    return FakeGeneration(STEPS)


@pytest.fixture
def addr(fake):
    with FakeServer(fake) as a:
        yield a


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stream_yields_each_step_and_finishes_with_stats(addr):
    with TreespecClient(addr) as c:
        chunks = list(c.generate_stream(prompt_ids=[7, 8], max_tokens=6))
    assert [ch.token_ids for ch in chunks] == STEPS
    assert [ch.finish_reason for ch in chunks] == [None, None, "length"]
    assert chunks[0].stats is None
    assert chunks[-1].stats == {"steps": 3, "draft_tokens": 12, "accepted_tokens": 3,
                                "fallback_steps": 0, "planned_plain_steps": 0,
                                "prompt_tokens": 2,
                                "completion_tokens": 6, "cached_tokens": 0}


def test_generate_collects_a_completion(addr):
    with TreespecClient(addr) as c:
        done = c.generate(prompt_ids=[7, 8], max_tokens=6)
    assert done == Completion(token_ids=[1, 2, 3, 4, 5, 6], text="", finish_reason="length",
                              stats=done.stats)
    assert done.stats["completion_tokens"] == 6


def test_arguments_map_to_the_request(addr, fake):
    with TreespecClient(addr) as c:
        c.generate("hello", max_tokens=9, stop_token_ids=[4, 5], ignore_eos=True,
                   no_speculation=True, top_p=0.5, top_k=7, seed=11, request_id="r1")
    r = fake.requests[-1]
    assert (r.prompt, list(r.prompt_ids), r.max_tokens) == ("hello", [], 9)
    assert (list(r.stop_token_ids), r.ignore_eos, r.no_speculation, r.request_id) == \
        ([4, 5], True, True, "r1")
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.top_k, r.sampling.seed) == \
        (0.0, 0.5, 7, 11)
    # what was not given is not sent: the server's defaults apply
    assert not r.sampling.HasField("temperature") and not r.sampling.HasField("min_p")


def test_text_deltas_concatenate(fake, addr):
    fake.tokenizer = True
    with TreespecClient(addr) as c:
        assert c.generate(prompt="x", max_tokens=6).text == "<1><2><3><4><5><6>"


@pytest.mark.parametrize("kw, says", [
    (dict(), "exactly one"), (dict(prompt="a", prompt_ids=[1]), "exactly one"),
    (dict(prompt_ids=[1], max_tokens=0), "max_tokens"),
    (dict(prompt_ids=[1], max_tokens=1 << 31), "max_tokens"),
    (dict(prompt_ids=[1, 1 << 31]), "prompt_ids"), (dict(prompt_ids=[-1]), "prompt_ids"),
    (dict(prompt_ids=["7"]), "prompt_ids"), (dict(prompt_ids=[1], stop_token_ids=[1 << 31]),
                                             "stop_token_ids"),
    (dict(prompt_ids=[1], top_k=1 << 31), "top_k"), (dict(prompt_ids=[1], seed=-1), "seed"),
    (dict(prompt_ids=[1], temperature="hot"), "temperature")])
def test_what_the_message_cannot_carry_is_invalid_argument(kw, says):
    with pytest.raises(TreespecError) as err:
        build_request(**kw)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details


def test_server_error_carries_code_and_details(addr):
    with TreespecClient(addr) as c, pytest.raises(TreespecError) as err:
        c.generate(prompt_ids=[1], max_tokens=4, temperature=-0.7)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details == "temperature must be >= 0"
    assert str(err.value) == "INVALID_ARGUMENT: temperature must be >= 0"


def test_unreachable_server_is_unavailable():
    with TreespecClient(f"127.0.0.1:{free_port()}") as c, pytest.raises(TreespecError) as err:
        c.generate(prompt_ids=[1], max_tokens=4, timeout=5)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_leaving_a_stream_early_cancels_the_call():
    fake = FakeGeneration([[i] for i in range(50)], step_delay_s=0.05)
    with FakeServer(fake) as addr, TreespecClient(addr) as c:
        for chunk in c.generate_stream(prompt_ids=[1], max_tokens=50):
            break
        assert fake.cancelled.wait(5.0)


def test_info(addr):
    with TreespecClient(addr) as c:
        info = c.info()
    assert (info.model, info.vocab_size, info.eos_token_ids) == ("fake", 96, [95])
    assert info.draft_connected and info.proposer == "ngram" and not info.has_tokenizer
    assert info.envelope == {"name": "chain4", "depth": 4, "topk": 1, "num_nodes": 4}


def test_wait_ready_returns_once_serving(addr):
    with TreespecClient(addr) as c:
        c.wait_ready(5.0)


def test_wait_ready_times_out_when_not_serving(fake):
    with FakeServer(fake, serving=False) as addr, TreespecClient(addr) as c:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="NOT_SERVING"):
            c.wait_ready(0.5)
        assert time.monotonic() - start < 10.0


def test_wait_ready_times_out_with_nothing_listening():
    with TreespecClient(f"127.0.0.1:{free_port()}") as c, pytest.raises(TimeoutError):
        c.wait_ready(0.5)


def test_async_client(addr, fake):
    async def main():
        async with AsyncTreespecClient(addr) as c:
            await c.wait_ready(5.0)
            info = await c.info()
            chunks = [ch async for ch in c.generate_stream(prompt_ids=[1, 2], max_tokens=6)]
            done = await c.generate(prompt_ids=[1, 2], max_tokens=6, no_speculation=True)
            with pytest.raises(TreespecError) as err:
                await c.generate(prompt_ids=[1], max_tokens=2, temperature=-1.0)
            return info, chunks, done, err.value

    info, chunks, done, err = asyncio.run(main())
    assert info.model == "fake"
    assert [ch.token_ids for ch in chunks] == STEPS and chunks[-1].finish_reason == "length"
    assert done.token_ids == [1, 2, 3, 4, 5, 6] and done.stats["draft_tokens"] == 0
    assert fake.requests[-2].no_speculation
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT


def test_async_stream_closed_early_cancels_the_call():
    fake = FakeGeneration([[i] for i in range(50)], step_delay_s=0.05)

    async def main():
        async with AsyncTreespecClient(addr) as c:
            stream = c.generate_stream(prompt_ids=[1], max_tokens=50)
            async for _ in stream:
                break
            await stream.aclose()

    with FakeServer(fake) as addr:
        asyncio.run(main())
        assert fake.cancelled.wait(5.0)
