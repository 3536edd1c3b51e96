"""A long prompt joining running streams: how long they wait, and its time to first token.

    python bench/long_prompt.py --out bench/results/long_prompt.json [--long 32768]
        [--streams 16] [--prefill-tokens 2048,512,65536] [--target-shape qwen3-8b]

Per --prefill-tokens value, one `treespec verify` (plain decode, no draft; the value that is
at least --long is the unchunked reference): --streams streams decode --ctx-token prompts;
once each has its first tokens, one --long-token prompt arrives (one new token). Reports the
streams' median gap between two tokens before it (a plain step), their longest gap while it
was prefilled, in plain steps, and its time to first token against the unchunked one's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import shapes
from e2e_bench import start
from treespec.common.client import AsyncTreespecClient
from treespec.common.serving.launch import cli_command


async def one_setting(addr: str, a: argparse.Namespace) -> dict:
    g = random.Random(0)
    prompts = [[g.randrange(3, 150000) for _ in range(a.ctx)] for _ in range(a.streams)]
    long_prompt = [g.randrange(3, 150000) for _ in range(a.long)]
    stamps: list[list[float]] = [[] for _ in prompts]
    async with AsyncTreespecClient(addr, timeout=900) as c:
        await c.wait_ready(600)
        await c.generate(prompt_ids=long_prompt[:a.ctx], max_tokens=4)       # warm

        async def stream(i: int) -> None:
            async for _ in c.generate_stream(prompt_ids=prompts[i], max_tokens=a.max_tokens,
                                             ignore_eos=True):
                stamps[i].append(time.perf_counter())

        tasks = [asyncio.create_task(stream(i)) for i in range(a.streams)]
        while min(len(s) for s in stamps) < 32:
            await asyncio.sleep(0.01)
        t_sent = time.perf_counter()
        await c.generate(prompt_ids=long_prompt, max_tokens=1)
        t_first = time.perf_counter()
        await asyncio.gather(*tasks)
    gaps = [(s[k + 1], s[k + 1] - s[k]) for s in stamps for k in range(8, len(s) - 1)]
    before = [gap for t, gap in gaps if t < t_sent]
    during = [gap for t, gap in gaps if t_sent < t <= t_first + 0.05]
    step = statistics.median(before)
    return {"plain_step_ms": 1e3 * step, "longest_gap_ms": 1e3 * max(during, default=0.0),
            "longest_gap_steps": max(during, default=0.0) / step,
            "ttft_s": t_first - t_sent}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/treespec-long-prompt")
    ap.add_argument("--target-shape", default="qwen3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--prefill-tokens", default="2048,512,65536")
    a = ap.parse_args()
    work = Path(a.work)
    if not (work / "target" / "config.json").exists():
        shapes.save_checkpoint(shapes.random_hf_model(a.target_shape, a.device), work / "target")
    pages = -(-(a.streams * (a.ctx + a.max_tokens + 80) + a.long + 80) // 16) + 64
    out: dict[str, dict] = {}
    for chunk in a.prefill_tokens.split(","):
        argv = cli_command("verify", "--model", str(work / "target"), "--port", "0",
                           "--device", a.device, "--max-batch", str(a.streams + 1),
                           "--num-blocks", str(pages), "--prefill-tokens", chunk)
        with start(f"verify-{chunk}", argv) as verify:
            out[chunk] = asyncio.run(one_setting(verify.addr, a))
        print(f"--prefill-tokens {chunk}: {json.dumps(out[chunk])}", flush=True)
    ref = out[max(out, key=int)]["ttft_s"]
    for r in out.values():
        r["ttft_over_unchunked"] = r["ttft_s"] / ref
    Path(a.out).write_text(json.dumps({"args": vars(a), "settings": out}, indent=1))


if __name__ == "__main__":
    main()
