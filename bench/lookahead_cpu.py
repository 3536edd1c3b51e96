"""Lookahead drafting on two CPU cores as two devices: serial against pre-drafted steps.

    python bench/lookahead_cpu.py --out bench/results/lookahead_cpu.json
        [--methods model,ngram] [--lookahead 0,1,2] [--batches 1,4] [--prompt-tokens 1024]
        [--max-tokens 128] [--envelope chain4] [--repeats 2]

Both services run as `treespec` child processes on the shipped tiny pair, the verify
pinned to core 0 and the draft to core 1 (taskset), one torch thread each, so the draft
computes while the target verifies exactly as a draft on its own GPU would. Prompts are
the first --prompt-tokens tokens of the target's held-out files. Per method and
--lookahead value, one service pair (the verify with --speculation always: every step
speculates, so rows compare the mechanism, not the controller), each batch decoded plain
(no_speculation) and speculatively, --repeats times alternating; reported: tok/s of
both, their ratio, tokens per step, lookahead hits and misses (the verify's /metrics),
and whether speculative output equals plain. The rows of one method with different
--lookahead values are the A/B (lookahead 0: today's serial step).
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

from bench_accept import envelope_args, held_out_prompts
from treespec.common.client import TreespecClient
from treespec.common.model.paths import SHIPPED_DRAFTS, resolve_model
from treespec.common.serving.launch import cli_command, start_process

COUNTER = re.compile(r'^treespec:lookahead_(hits|misses)_total\{[^}]*\} ([0-9.e+]+)', re.M)


def lookahead_counts(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in COUNTER.findall(text)}


def pinned(core: int, *args: str) -> list[str]:
    return ["taskset", "-c", str(core), *cli_command(*args)]


def decode(c: TreespecClient, prompts: list[list[int]], max_tokens: int, plain: bool
           ) -> tuple[float, list]:
    """All prompts at once (one stream each): (seconds, outputs)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: c.generate(prompt_ids=p, max_tokens=max_tokens,
                                                  ignore_eos=True, no_speculation=plain),
                             prompts))
    return time.perf_counter() - t0, outs


def one_pair(a: argparse.Namespace, method: str, k: int, prompts: list[list[int]]) -> list[dict]:
    target = str(resolve_model(a.model))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    dargs = ["draft", "--method", method, *envelope_args(a.envelope), "--port", "0",
             "--device", "cpu", "--lookahead", str(k)]
    if SHIPPED_DRAFTS.get(method):
        dargs += ["--model", SHIPPED_DRAFTS[method]]
    if method == "dflash":          # no embedding or LM head of its own
        dargs += ["--target-embeddings", target]
    rows = []
    with start_process("draft", pinned(1, *dargs), 180, env) as draft, start_process(
            "verify", pinned(0, "verify", "--model", target, "--draft", draft.addr, "--port", "0",
                             "--device", "cpu", "--speculation", "always",
                             "--metrics-port", "0", "--step-deadline-ms", "10000"),
            180, env) as verify:
        url = re.search(r"metrics on (http://\S+/metrics)", verify.output()).group(1)
        with TreespecClient(verify.addr, timeout=600) as c:
            c.wait_ready(180)
            while not c.info().draft_connected:
                time.sleep(0.1)
            decode(c, prompts[:1], 16, False)                    # warm both paths
            decode(c, prompts[:1], 16, True)
            for b in a.batches:
                ps = prompts[:b]
                runs = {True: [], False: []}
                before = lookahead_counts(url)
                for _ in range(a.repeats):
                    for plain in (True, False):
                        runs[plain].append(decode(c, ps, a.max_tokens, plain))
                after = lookahead_counts(url)
                spec = [o for _, outs in runs[False] for o in outs]
                made = sum(o.stats["completion_tokens"] - 1 for o in spec)
                steps = sum(o.stats["steps"] for o in spec)
                tok = b * a.max_tokens
                hits = after.get("hits", 0) - before.get("hits", 0)
                misses = after.get("misses", 0) - before.get("misses", 0)
                rows.append({
                    "method": method, "lookahead": k, "batch": b,
                    "plain_tok_s": statistics.median(tok / s for s, _ in runs[True]),
                    "spec_tok_s": statistics.median(tok / s for s, _ in runs[False]),
                    "spec_tok_s_runs": [tok / s for s, _ in runs[False]],
                    "tokens_per_step": made / max(1, steps),
                    "hits": hits, "misses": misses,
                    "hit_rate": hits / max(1.0, hits + misses),
                    "identical": all(
                        [o.token_ids for o in x] == [o.token_ids for o in y]
                        for (_, x), (_, y) in zip(runs[True], runs[False]))})
                r = rows[-1]
                r["x_plain"] = r["spec_tok_s"] / r["plain_tok_s"]
                print(json.dumps({k2: (round(v, 3) if isinstance(v, float) else v)
                                  for k2, v in r.items() if k2 != "spec_tok_s_runs"}),
                      flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny-code")
    ap.add_argument("--methods", default="model,ngram")
    ap.add_argument("--lookahead", default="0,1,2")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--envelope", default="chain4")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    a.batches = [int(x) for x in a.batches.split(",")]
    prompts = held_out_prompts(resolve_model(a.model), max(a.batches), a.prompt_tokens)
    rows = []
    for method in a.methods.split(","):
        for k in (int(x) for x in a.lookahead.split(",")):
            rows += one_pair(a, method, k, prompts)
    Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
