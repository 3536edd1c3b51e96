"""Continuous batching: concurrent requests give the ids each gives alone; cancelled
requests return their pages; bad requests get INVALID_ARGUMENT and lose nothing."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from treespec.common.client import AsyncTreespecClient, TreespecError
from inproc import greedy_reference, services
from tests_data import EOS_PROMPT

PROMPTS = [[1 + i, 5, 9 + i, 13, 2, 7, 1 + i, 5, 9 + i] for i in range(8)]


@pytest.mark.parametrize("busy_poll", ["off", "on"])
def test_eight_concurrent_requests_equal_each_alone(target_dir, draft_dir, busy_poll):
    """Each equals transformers' greedy decode of its prompt alone (the service's own
    output for a request alone is that too: tests/test_lossless.py)."""
    async def go():
        async with services(target_dir, "model", draft_dir, "tree-small", max_batch=8,
                            busy_poll=busy_poll) as h:
            async with AsyncTreespecClient(h["addr"]) as c:
                lens = [8 + 3 * i for i in range(8)]   # finish at different steps
                together = await asyncio.gather(*[
                    c.generate(prompt_ids=p, max_tokens=n, ignore_eos=True)
                    for p, n in zip(PROMPTS, lens)])
            return together, lens, h["engine"].kv_pages_used == 0
    together, lens, free = asyncio.run(go())
    for p, n, a in zip(PROMPTS, lens, together):
        assert a.token_ids == greedy_reference(target_dir, p, n)
    assert free


@pytest.mark.parametrize("busy_poll", ["off", "on"])
def test_a_batch_mixing_speculative_and_plain_requests(target_dir, draft_dir, busy_poll):
    """Only some running sequences get trees (no_speculation on the others): the
    proposal's rows are laid out over the whole batch and every output is exact."""
    async def go():
        async with services(target_dir, "model", draft_dir, "chain4", max_batch=4,
                            busy_poll=busy_poll) as h:
            async with AsyncTreespecClient(h["addr"]) as c:
                return await asyncio.gather(*[
                    c.generate(prompt_ids=p, max_tokens=16, ignore_eos=True,
                               no_speculation=i % 2 == 1)
                    for i, p in enumerate(PROMPTS[:4])])
    outs = asyncio.run(go())
    for i, (p, out) in enumerate(zip(PROMPTS, outs)):
        assert out.token_ids == greedy_reference(target_dir, p, 16)
        assert (out.stats["draft_tokens"] > 0) == (i % 2 == 0)


def test_cancelled_streams_return_every_page(target_dir):
    async def go():
        async with services(target_dir, "ngram", envelope="chain4") as h:
            async with AsyncTreespecClient(h["addr"]) as c:
                async def partial(p):
                    async for chunk in c.generate_stream(prompt_ids=p, max_tokens=400,
                                                         ignore_eos=True):
                        if chunk.token_ids:
                            break      # leaving the stream cancels the call
                await asyncio.gather(*[partial(p) for p in PROMPTS[:4]])
                await asyncio.sleep(0.5)
                free_after_cancel = h["engine"].kv_pages_used == 0
                ok = await c.generate(prompt_ids=PROMPTS[0], max_tokens=6, ignore_eos=True)
            return free_after_cancel, ok, not h["engine"].running
    free, ok, idle = asyncio.run(go())
    assert free and idle
    assert ok.token_ids == greedy_reference(target_dir, PROMPTS[0], 6)


def test_stop_tokens_and_eos_end_the_request(target_dir):
    ref = greedy_reference(target_dir, EOS_PROMPT, 12)

    async def go():
        async with services(target_dir, "ngram") as h:
            async with AsyncTreespecClient(h["addr"]) as c:
                stop_at = ref[5]
                a = await c.generate(prompt_ids=EOS_PROMPT, max_tokens=12, ignore_eos=True,
                                     stop_token_ids=[stop_at])
                return a, stop_at
    a, stop_at = asyncio.run(go())
    cut = ref.index(stop_at) + 1
    assert a.token_ids == ref[:cut] and a.finish_reason == "stop"


@pytest.mark.parametrize("kw, message", [
    (dict(prompt_ids=[1, 2], temperature=-0.5), "temperature must be >= 0"),
    (dict(prompt_ids=[1, 2], temperature=float("nan")), "temperature must be >= 0"),
    (dict(prompt_ids=[1, 2], temperature=1.0, top_p=0.0), "top_p must be in (0, 1]"),
    (dict(prompt_ids=[1, 2], temperature=1.0, top_p=1.5), "top_p must be in (0, 1]"),
    (dict(prompt_ids=[1, 2], top_k=-1), "top_k must be >= 0"),
    (dict(prompt_ids=[1, 2], min_p=1.5), "min_p must be in [0, 1]"),
    (dict(prompt_ids=[1, 500]), "outside the vocabulary"),
    (dict(prompt="hello"), "no tokenizer"),
])
def test_bad_requests_are_invalid_argument(target_dir, kw, message):
    async def go():
        async with services(target_dir, "ngram") as h:
            async with AsyncTreespecClient(h["addr"]) as c:
                with pytest.raises(TreespecError) as err:
                    await c.generate(max_tokens=4, **kw)
                good = await c.generate(prompt_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)
            return err.value, good, h["engine"].kv_pages_used == 0
    err, good, free = asyncio.run(go())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and message in err.details
    assert good.token_ids == greedy_reference(target_dir, [1, 2, 3], 4) and free


def test_a_failing_prefill_returns_pages_and_tells_the_client(target_dir):
    """An exception inside a forward fails that iteration's requests cleanly."""
    async def go():
        async with services(target_dir, None) as h:
            engine = h["engine"]
            real = engine.verifier.prefill
            calls = {"n": 0}

            def flaky(*a):
                calls["n"] += 1
                if calls["n"] == 1:
                    raise RuntimeError("injected prefill failure")
                return real(*a)
            engine.verifier.prefill = flaky
            async with AsyncTreespecClient(h["addr"]) as c:
                with pytest.raises(TreespecError) as err:
                    await c.generate(prompt_ids=[1, 2, 3], max_tokens=5, ignore_eos=True)
                second = await c.generate(prompt_ids=[1, 2, 3], max_tokens=5, ignore_eos=True)
            await asyncio.sleep(0.1)
            return err.value, second, engine.kv_pages_used
    err, second, used = asyncio.run(go())
    assert err.code == grpc.StatusCode.INTERNAL and "injected prefill failure" in err.details
    assert second.token_ids == greedy_reference(target_dir, [1, 2, 3], 5)
    assert used == 0


def test_one_token_requests_finish_at_prefill(target_dir):
    async def go():
        async with services(target_dir, "ngram") as h:
            async with AsyncTreespecClient(h["addr"]) as c:
                outs = await asyncio.gather(*[c.generate(prompt_ids=p, max_tokens=1,
                                                         ignore_eos=True) for p in PROMPTS[:3]])
            return outs, h["engine"].kv_pages_used
    outs, used = asyncio.run(go())
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == greedy_reference(target_dir, p, 1) and o.stats["steps"] == 0
    assert used == 0
