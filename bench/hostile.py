"""The hostile client's cases (issue 17) against both services as `treespec` CLI
processes on loopback, each with the status it gets now and what it cost the others.

    python bench/hostile.py [--target tiny-code] [--draft-model tiny-code-draft] [--out F]

The draft (the draft model; n-gram with --draft-model "") and the verify run with bearer tokens on both hops; the probes
that must get past authentication carry the token. Prints one line a case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path


import grpc

from treespec.common.wire import convert as wire
from treespec.common.serving.auth import metadata
from treespec.common.client import AsyncTreespecClient, TreespecError
from treespec.common.serving.launch import start_service
from treespec.common.spec.messages import SeqUpdate, SpecRequest
from treespec.protos.treespec.v1 import treespec_pb2 as pb

KEY = "hostile-probe-key"


def status(e: BaseException | None) -> str:
    if e is None:
        return "OK"
    code = getattr(e, "code", None)
    code = code() if callable(code) else code
    return getattr(code, "name", type(e).__name__)


async def generate_case(c: AsyncTreespecClient, **kw) -> tuple[str, float]:
    t0 = time.perf_counter()
    try:
        await c.generate(max_tokens=kw.pop("max_tokens", 4), **kw)
        e = None
    except TreespecError as err:
        e = err
    return status(e), time.perf_counter() - t0


async def with_steady_stream(c: AsyncTreespecClient, probe) -> tuple[object, float]:
    """probe's result and the longest gap between another stream's tokens meanwhile."""
    gaps, last = [], None

    async def steady():
        nonlocal last
        async for _ in c.generate_stream(prompt_ids=[1, 2, 3], max_tokens=120, ignore_eos=True):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now

    async def later():
        await asyncio.sleep(0.2)
        return await probe()
    _, got = await asyncio.gather(steady(), later())
    return got, max(gaps)


async def speculate(addr: str, msg: pb.SpeculateRequest | bytes, key: str | None) -> str:
    """The status of a Speculate stream that sends msg and reads every answer."""
    async with grpc.aio.insecure_channel(addr, options=[("grpc.max_send_message_length",
                                                         256 << 20)]) as ch:
        call = ch.stream_stream("/treespec.v1.Drafter/Speculate",
                                request_serializer=lambda m: m if isinstance(m, bytes)
                                else m.SerializeToString())(metadata=metadata(key))
        try:
            await call.write(msg)
            await call.done_writing()
            async for _ in call:
                pass
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        return (await call.code()).name


def full(seq_id: int, n: int) -> SeqUpdate:
    return SeqUpdate(seq_id=seq_id, committed_len=n, new_tokens=[1 + i % 50 for i in range(n)],
                     full=True)


async def probes(vaddr: str, daddr: str) -> dict[str, str]:
    out: dict[str, str] = {}
    async with AsyncTreespecClient(vaddr, api_key=KEY) as c:
        for mb in (1, 4, 20):
            text = ("def f(x):\n    return x\n" * (mb * 50_000))[:mb * 1_000_000]
            (st, t), gap = await with_steady_stream(c, lambda: generate_case(c, prompt=text))
            out[f"{mb} MB text prompt"] = f"{st} in {t:.2f} s; other stream's worst gap {gap:.3f} s"
        cases = {"stop id outside the vocabulary": dict(prompt_ids=[1], stop_token_ids=[10 ** 9]),
                 "10^6 stop ids": dict(prompt_ids=[1], stop_token_ids=list(range(10 ** 6))),
                 "1 MB request_id": dict(prompt_ids=[1], request_id="x" * 1_000_000)}
        for name, kw in cases.items():
            st, t = await generate_case(c, **kw)
            out[name] = f"{st} in {t:.3f} s"
        results = await asyncio.gather(*(generate_case(c, prompt_ids=[1, 2, 3], max_tokens=8)
                                         for _ in range(2000)))
        counts: dict[str, int] = {}
        for st, _ in results:
            counts[st] = counts.get(st, 0) + 1
        out["2000 simultaneous calls"] = json.dumps(counts)
    async with AsyncTreespecClient(vaddr) as c:
        out["Generate without a token"] = (await generate_case(c, prompt_ids=[1]))[0]
    async with grpc.aio.insecure_channel(vaddr) as ch:
        try:
            await ch.unary_stream("/treespec.v1.Generation/Generate")(
                b"\xff\xff\xff", metadata=metadata(KEY)).read()
            out["undecodable Generate"] = "OK"
        except grpc.aio.AioRpcError as e:
            out["undecodable Generate"] = e.code().name
    spoof = wire.spec_request_to_pb(SpecRequest(1, [], released=list(range(64))))
    out["draft: `released` without the token"] = await speculate(daddr, spoof, None)
    for n in (8000, 20000):
        t0 = time.perf_counter()
        st = await speculate(daddr, wire.spec_request_to_pb(SpecRequest(1, [full(7, n)])), KEY)
        out[f"draft: one full sequence of {n} tokens"] = f"{st} in {time.perf_counter() - t0:.2f} s"
    many = SpecRequest(1, [full(i, 4) for i in range(5000)])
    out["draft: 5000 sequences in a request"] = await speculate(
        daddr, wire.spec_request_to_pb(many), KEY)
    out["draft: undecodable Speculate"] = await speculate(daddr, b"\xff\xff\xff", KEY)
    return out


async def drained(vaddr: str, verify) -> str:
    async with AsyncTreespecClient(vaddr, api_key=KEY) as c:
        got: list[int] = []
        try:
            async for chunk in c.generate_stream(prompt_ids=[1, 2, 3], max_tokens=2000,
                                                 ignore_eos=True):
                got += chunk.token_ids
                if len(got) == 5:
                    verify.proc.send_signal(15)
            return f"OK after {len(got)} tokens"
        except TreespecError as e:
            return f"{status(e)} after {len(got)} tokens ({e})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny-code")
    ap.add_argument("--draft-model", default="tiny-code-draft")
    ap.add_argument("--out")
    ap.add_argument("--log", action="store_true", help="print both services' logs")
    a = ap.parse_args()
    keys = Path(tempfile.mkdtemp()) / "keys"
    keys.write_text(KEY + "\n")
    method = ["--method", "model", "--model", a.draft_model] if a.draft_model \
        else ["--method", "ngram"]
    draft = start_service("draft", ["draft", *method, "--port", "0", "--api-key-file", str(keys)])
    verify = start_service("verify", ["verify", "--model", a.target, "--draft", draft.addr,
                                      "--port", "0", "--api-key-file", str(keys),
                                      "--draft-api-key-file", str(keys)])
    try:
        out = asyncio.run(probes(verify.addr, draft.addr))
        out["SIGTERM mid-stream (5 s grace)"] = asyncio.run(drained(verify.addr, verify))
    finally:
        verify.stop(5)
        draft.stop(5)
    for k, v in out.items():
        print(f"{k}: {v}")
    for name, svc in (("verify", verify), ("draft", draft)):
        lines = svc.output().splitlines()
        print(f"{name} log: {len(lines)} lines, {sum('Traceback' in x for x in lines)} tracebacks")
        if a.log:
            print("\n".join(lines))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
