"""Prefix caching on the CPU: a multi-turn chat with a long shared system prompt, with the
cache and without it (--no-prefix-caching), in one run.

    python bench/prefix_cache.py --out bench/results/prefix_cache_cpu.json
        [--conversations 16] [--turns 5] [--system-tokens 1000] [--user-tokens 48]
        [--max-tokens 32] [--method model]

Per setting, one service pair on the shipped tiny pair (the verify pinned to core 0, the
draft to core 1, one torch thread each, the verify with --speculation always so that
tokens per step measure the drafter, not the controller; both services get the setting's
flag). All conversations run at once, each its turns in order: turn t's prompt is the
system prompt (the first --system-tokens tokens of the target's first held-out file),
then for each turn so far a user message (--user-tokens tokens of the conversation's own
held-out file) and the answer (--max-tokens greedy tokens, EOS ignored). Reported per
setting: time to first token (median, p90) of turn 1 and of turns 2..T, prompt tokens
cached, total completion tok/s (all conversations, wall clock), tokens per step; and
whether every answer is the same with and without the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_accept import held_out_prompts
from treespec.common.client import TreespecClient
from treespec.common.model.paths import SHIPPED_DRAFTS, resolve_model
from treespec.common.serving.launch import cli_command, start_process

COUNTER = re.compile(r'^vllm:prefix_cache_(queries|hits)_total\{[^}]*\} ([0-9.e+]+)', re.M)


def pinned(core: int, *args: str) -> list[str]:
    return ["taskset", "-c", str(core), *cli_command(*args)]


def counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return {k: float(v) for k, v in COUNTER.findall(r.read().decode())}


def turn(c: TreespecClient, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, ids, stats = None, [], {}
    for ch in c.generate_stream(prompt_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                                temperature=0.0):
        ttft = ttft if ttft is not None else time.perf_counter() - t0
        ids += ch.token_ids
        stats = ch.stats or stats
    return {"ttft": ttft, "ids": ids, "stats": stats}


def conversation(c: TreespecClient, system: list[int], user: list[list[int]],
                 max_tokens: int) -> list[dict]:
    history, out = list(system), []
    for msg in user:
        history += msg
        r = turn(c, history, max_tokens)
        history += r["ids"]
        out.append(r)
    return out


def one_setting(a: argparse.Namespace, cache: bool, system: list[int],
                users: list[list[list[int]]]) -> tuple[dict, list]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    flag = [] if cache else ["--no-prefix-caching"]
    dargs = ["draft", "--method", a.method, "--port", "0", "--device", "cpu",
             "--max-sequences", "256", *flag]
    if SHIPPED_DRAFTS.get(a.method):
        dargs += ["--model", SHIPPED_DRAFTS[a.method]]
    with start_process("draft", pinned(1, *dargs), 180, env) as draft, start_process(
            "verify", pinned(0, "verify", "--model", str(resolve_model(a.model)), "--draft",
                             draft.addr, "--port", "0", "--device", "cpu", "--speculation",
                             "always", "--metrics-port", "0", "--step-deadline-ms", "10000",
                             "--max-batch", str(a.conversations), *flag), 180, env) as verify:
        url = re.search(r"metrics on (http://\S+/metrics)", verify.output()).group(1)
        with TreespecClient(verify.addr, timeout=1200) as c:
            c.wait_ready(180)
            while not c.info().draft_connected:
                time.sleep(0.1)
            conversation(c, [7] * 40, [[8] * 8], 8)            # warm both services
            before = counters(url) if cache else {}
            t0 = time.perf_counter()
            with ThreadPoolExecutor(a.conversations) as pool:
                convs = list(pool.map(lambda u: conversation(c, system, u, a.max_tokens),
                                      users))
            wall = time.perf_counter() - t0
            after = counters(url) if cache else {}
    turns = [r for conv in convs for r in conv]
    later = [r["ttft"] for conv in convs for r in conv[1:]]
    first = [r["ttft"] for conv in convs for r in conv[:1]]
    made = sum(r["stats"]["completion_tokens"] for r in turns)
    row = {
        "prefix_caching": cache, "wall_s": wall, "tok_s": made / wall,
        "ttft_turn1_median_s": statistics.median(first),
        "ttft_turn1_p90_s": statistics.quantiles(first, n=10)[-1],
        "ttft_later_median_s": statistics.median(later),
        "ttft_later_p90_s": statistics.quantiles(later, n=10)[-1],
        "prompt_tokens": sum(r["stats"]["prompt_tokens"] for r in turns),
        "cached_tokens": sum(r["stats"]["cached_tokens"] for r in turns),
        "cached_tokens_later": sum(r["stats"]["cached_tokens"] for conv in convs
                                   for r in conv[1:]),
        "tokens_per_step": sum(r["stats"]["completion_tokens"] - 1 for r in turns)
        / max(1, sum(r["stats"]["steps"] for r in turns)),
        "tokens_per_step_later": sum(r["stats"]["completion_tokens"] - 1 for conv in convs
                                     for r in conv[1:])
        / max(1, sum(r["stats"]["steps"] for conv in convs for r in conv[1:])),
        "prefix_cache_queries": after.get("queries", 0) - before.get("queries", 0),
        "prefix_cache_hits": after.get("hits", 0) - before.get("hits", 0),
    }
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
          flush=True)
    return row, [[r["ids"] for r in conv] for conv in convs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny-code")
    ap.add_argument("--method", default="model")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    files = held_out_prompts(resolve_model(a.model), a.conversations + 1,
                             max(a.system_tokens, a.turns * a.user_tokens))
    system = files[0][:a.system_tokens]
    users = [[f[t * a.user_tokens:(t + 1) * a.user_tokens] for t in range(a.turns)]
             for f in files[1:]]
    rows, outputs = [], []
    for cache in (True, False):
        row, out = one_setting(a, cache, system, users)
        rows.append(row)
        outputs.append(out)
    on, off = rows
    summary = {"identical": outputs[0] == outputs[1],
               "ttft_later_median_x": off["ttft_later_median_s"] / on["ttft_later_median_s"],
               "tok_s_x": on["tok_s"] / off["tok_s"]}
    print(json.dumps(summary), flush=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows, "summary": summary},
                                      indent=1))


if __name__ == "__main__":
    main()
