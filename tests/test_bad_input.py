"""A client's mistakes cost it alone: INVALID_ARGUMENT naming the field, refused before
any work; a multi-megabyte text prompt is refused unread or tokenized off the event
loop, so other streams keep flowing (the shipped tiny-code target, which has a
tokenizer, plain decode)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from treespec.common.client import AsyncTreespecClient, TreespecError
from inproc import services

TARGET = "tiny-code"


def test_fields_are_checked_before_any_work():
    async def go():
        async with services(TARGET, max_prompt_bytes=1 << 20) as h:
            async with AsyncTreespecClient(h["addr"]) as c:
                cases = [(dict(prompt_ids=[1, 2], stop_token_ids=[10 ** 9]), "stop_token_ids"),
                         (dict(prompt_ids=[1, 2], stop_token_ids=list(range(2000))),
                          "stop_token_ids"),
                         (dict(prompt_ids=[1, 2], request_id="x" * 100_000), "request_id"),
                         (dict(prompt="y" * (2 << 20)), "prompt"),
                         (dict(prompt_ids=[1, 2], temperature=float("inf")), "temperature"),
                         (dict(prompt_ids=[1, 2], temperature=1e30), "temperature"),
                         (dict(prompt_ids=[1 << 31]), "prompt_ids")]
                for kw, field in cases:
                    with pytest.raises(TreespecError) as err:
                        await c.generate(max_tokens=4, **kw)
                    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
                    assert field in str(err.value)
    asyncio.run(go())


def test_a_long_prompt_does_not_stall_other_streams():
    """One 1 MB prompt (just under the cap; tokenizing it takes the better part of a
    second) while another stream decodes: the other's tokens keep arriving."""
    async def go():
        async with services(TARGET, max_prompt_bytes=2 << 20) as h:
            async with AsyncTreespecClient(h["addr"]) as c:
                gaps, last = [], None

                async def steady():
                    nonlocal last
                    async for _ in c.generate_stream(prompt_ids=[1, 2, 3], max_tokens=200,
                                                     ignore_eos=True):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now

                async def big():
                    await asyncio.sleep(0.2)
                    with pytest.raises(TreespecError):   # longer than the model's context
                        await c.generate(prompt="def f(x):\n    return x\n" * 40_000,
                                         max_tokens=1)
                t0 = time.perf_counter()
                await asyncio.gather(steady(), big())
                return max(gaps), time.perf_counter() - t0
    worst, took = asyncio.run(go())
    assert worst < 0.5, (worst, took)


REFUSED = [
    (("--max-model-len", "-1"), "--max-model-len must be >= 0"),
    (("--max-model-len", "99999999"), "past the checkpoint's 2048 positions"),
    (("--tls-cert", "/nonexistent.pem"), "--tls-cert and --tls-key go together"),
    (("--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"), "No such file"),
    (("--max-waiting", "0"), "--max-waiting must be >= 1"),
]


@pytest.fixture(scope="module")
def refusals() -> dict:
    """`treespec verify` with each refused flag, the processes run together (each
    spends seconds importing torch before it refuses)."""
    import services as cli
    procs = cli.run_clis(*[("verify", "--model", TARGET, "--port", "0", "--device", "cpu",
                            *flags) for flags, _ in REFUSED])
    return {flags: proc for (flags, _), proc in zip(REFUSED, procs)}


@pytest.mark.parametrize("flags, says", REFUSED)
def test_a_refused_flag_is_one_line_and_exit_code_2(flags, says, refusals):
    proc = refusals[flags]
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_sequence_past_the_draft_s_length_decodes_plainly(target_dir):
    """The draft says at handshake how long a sequence it takes: the verify service
    stops asking for that sequence's trees there, and the output stays plain decode's."""
    prompt = [5, 17, 23, 42, 8, 17, 23, 42, 8, 17, 23]

    async def go():
        async with services(target_dir, "ngram", draft_kw={"max_model_len": 24}) as h:
            assert h["engine"].link.info.max_model_len == 24
            async with AsyncTreespecClient(h["addr"]) as c:
                spec = await c.generate(prompt_ids=prompt, max_tokens=30, ignore_eos=True)
                plain = await c.generate(prompt_ids=prompt, max_tokens=30, ignore_eos=True,
                                         no_speculation=True)
            return spec, plain, dict(h["engine"].fallbacks)
    spec, plain, fallbacks = asyncio.run(go())
    assert spec.token_ids == plain.token_ids
    assert spec.stats["draft_tokens"] > 0 and fallbacks.get("draft_max_model_len", 0) > 0


def test_a_request_far_past_the_prompt_cap_is_refused_unread():
    async def go():
        async with services(TARGET, max_prompt_bytes=1 << 20) as h:
            async with AsyncTreespecClient(h["addr"]) as c:
                with pytest.raises(TreespecError) as err:
                    await c.generate(prompt="z" * (8 << 20), max_tokens=1)
                return err.value
    err = asyncio.run(go())
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err
