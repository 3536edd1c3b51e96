"""What the OpenAI-compatible front costs over the gRPC SDK, side by side in one run.

    python bench/openai_overhead.py --out bench/results/openai_overhead_cpu.json
        [--batches 1,32] [--max-tokens 64] [--pairs 3] [--method ngram]

Starts `treespec draft`, `treespec verify` and `treespec openai` on loopback with the
shipped tiny-code pair, then per batch size alternates the same batch of streamed greedy
completions (prompt token ids, --max-tokens new tokens each) through the gRPC client and
through the official `openai` client, --pairs times. Reports each path's tok/s (tokens
over the batch's wall time), the front's ratio to gRPC (median of the pairs) and the
median time to first token of each path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from openai import AsyncOpenAI

from e2e_bench import start
from treespec.common.client import AsyncTreespecClient
from treespec.common.model.paths import SHIPPED_DRAFTS, resolve_model
from treespec.common.serving.launch import cli_command


async def grpc_batch(c: AsyncTreespecClient, prompts: list[list[int]], n: int
                     ) -> tuple[float, list[float]]:
    async def one(p: list[int]) -> tuple[int, float]:
        t0, first, tokens = time.perf_counter(), None, 0
        async for ch in c.generate_stream(prompt_ids=p, max_tokens=n, ignore_eos=True):
            first = first or time.perf_counter() - t0
            tokens += len(ch.token_ids)
        return tokens, first

    t0 = time.perf_counter()
    got = await asyncio.gather(*[one(p) for p in prompts])
    return sum(t for t, _ in got) / (time.perf_counter() - t0), [f for _, f in got]


async def openai_batch(c: AsyncOpenAI, model: str, prompts: list[list[int]], n: int
                       ) -> tuple[float, list[float]]:
    async def one(p: list[int]) -> tuple[int, float]:
        t0, first, tokens = time.perf_counter(), None, 0
        stream = await c.completions.create(
            model=model, prompt=p, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for ev in stream:
            if ev.choices and first is None:
                first = time.perf_counter() - t0
            if ev.usage:
                tokens = ev.usage.completion_tokens
        return tokens, first

    t0 = time.perf_counter()
    got = await asyncio.gather(*[one(p) for p in prompts])
    return sum(t for t, _ in got) / (time.perf_counter() - t0), [f for _, f in got]


async def measure(verify: str, front: str, a: argparse.Namespace) -> dict:
    g = random.Random(0)
    out = {}
    async with AsyncTreespecClient(verify, timeout=600) as grpc_c:
        await grpc_c.wait_ready(120)
        api = AsyncOpenAI(base_url=f"http://{front}/v1", api_key="unused", max_retries=0,
                          timeout=600)
        model = (await api.models.list()).data[0].id
        for b in [int(x) for x in a.batches.split(",")]:
            prompts = [[g.randrange(3, 4000) for _ in range(a.prompt_tokens)] for _ in range(b)]
            await grpc_batch(grpc_c, prompts, 8)                      # warm both paths
            await openai_batch(api, model, prompts, 8)
            rows = []
            for _ in range(a.pairs):
                rows.append((await grpc_batch(grpc_c, prompts, a.max_tokens),
                             await openai_batch(api, model, prompts, a.max_tokens)))
            out[b] = {"grpc_tok_s": [r[0][0] for r in rows], "openai_tok_s": [r[1][0] for r in rows],
                      "ratio": statistics.median(r[1][0] / r[0][0] for r in rows),
                      "grpc_ttft_ms": 1e3 * statistics.median(f for r in rows for f in r[0][1]),
                      "openai_ttft_ms": 1e3 * statistics.median(f for r in rows for f in r[1][1])}
            print(f"b={b}: {json.dumps(out[b])}", flush=True)
        await api.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--method", default="ngram")
    a = ap.parse_args()
    target = str(resolve_model("tiny-code"))
    draft_model = () if a.method == "ngram" else ("--model", SHIPPED_DRAFTS[a.method])
    with start("draft", cli_command("draft", "--method", a.method, "--port", "0",
                                    "--device", "cpu", *draft_model)) as draft, \
         start("verify", cli_command("verify", "--model", target, "--port", "0", "--device",
                                     "cpu", "--draft", draft.addr, "--max-batch", "64")) as verify, \
         start("openai", cli_command("openai", "--verify", verify.addr, "--port", "0")) as front:
        out = asyncio.run(measure(verify.addr, front.addr, a))
    Path(a.out).write_text(json.dumps({"args": vars(a), "batches": out}, indent=1))


if __name__ == "__main__":
    main()
