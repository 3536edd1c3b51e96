"""Prefix caching: a multi-turn chat with a long shared system prompt, with the cache and
without it (--no-prefix-caching), in one run, on the CPU or on a GPU.

    python bench/prefix_cache.py --out bench/results/prefix_cache_cpu.json
        [--conversations 16] [--turns 5] [--system-tokens 1000] [--user-tokens 48]
        [--max-tokens 32] [--method model]
    python bench/prefix_cache.py --out prefix_cache.json --target-shape qwen3-8b
        --draft-shape qwen3-0.6b --device cuda [--work DIR] [--plant] [as above]

Per setting, one service pair, the verify with --speculation always (the default here) so
that tokens per step measure the drafter, not the controller (--speculation adaptive: as
users run it); both services get the setting's flag. By default the shipped tiny pair on
the CPU (the verify pinned to core 0, the draft to core 1, one torch thread each), and
prompts of held-out text: the system prompt is the first --system-tokens tokens of the
target's first held-out file, a user message --user-tokens tokens of the conversation's own
file. With --target-shape: random-weight HF checkpoints of those shapes (bench/shapes.py,
written under --work once), the target plain random weights (near-tied logits, so
"identical" holds only with the verify's default bit-exact kernels; --plant: a planted
successor map whose answers survive any reduction order; the random draft model is almost
never accepted either way, so tokens per step stay near 1), the services on
--device unpinned with bench/e2e_bench.py's verify flags, and prompts of random token ids.

All conversations run at once, each its turns in order: turn t's prompt is the system
prompt, then for each turn so far a user message and the answer (--max-tokens greedy
tokens, EOS ignored). Reported per setting: time to first token (median, p90) of turn 1
and of turns 2..T, prompt tokens cached, total completion tok/s (all conversations, wall
clock), tokens per step, the draft's acceptance; whether every answer is the same with
and without the cache; the device.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import shapes
from bench_accept import held_out_prompts
from e2e_bench import start, verify_argv
from step_metrics import metrics_url
from treespec.common.client import TreespecClient
from treespec.common.model.paths import SHIPPED_DRAFTS, resolve_model
from treespec.common.serving.launch import cli_command

COUNTER = re.compile(r'^vllm:prefix_cache_(queries|hits)_total\{[^}]*\} ([0-9.e+]+)', re.M)
Chat = tuple[list[int], list[list[list[int]]]]    # system prompt, [conversation][turn] user ids


def pinned(core: int, *args: str) -> list[str]:
    return ["taskset", "-c", str(core), *cli_command(*args)]


def counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return {k: float(v) for k, v in COUNTER.findall(r.read().decode())}


def held_out_chat(a: argparse.Namespace) -> Chat:
    files = held_out_prompts(resolve_model(a.model), a.conversations + 1,
                             max(a.system_tokens, a.turns * a.user_tokens))
    return files[0][:a.system_tokens], [
        [f[t * a.user_tokens:(t + 1) * a.user_tokens] for t in range(a.turns)]
        for f in files[1:]]


def random_ids(g: random.Random, n: int) -> list[int]:
    return [g.randrange(3, 150000) for _ in range(n)]


def random_chat(a: argparse.Namespace) -> Chat:
    g = random.Random(0)
    return random_ids(g, a.system_tokens), [
        [random_ids(g, a.user_tokens) for _ in range(a.turns)] for _ in range(a.conversations)]


def checkpoints(a: argparse.Namespace) -> tuple[str, str]:
    """(target dir, draft dir): random-weight checkpoints under --work, built once."""
    work, plant = Path(a.work), a.plant
    target = work / f"target-{a.target_shape}{'-planted' if plant else ''}"
    draft = work / f"draft-{a.draft_shape}"
    for path, shape, seed, planted in ((target, a.target_shape, 0, plant),
                                       (draft, a.draft_shape, 2, False)):
        if not (path / "config.json").exists():
            model = shapes.random_hf_model(shape, a.device, seed=seed, plant=planted)
            print(f"{path.name}: saved in {shapes.save_checkpoint(model, path):.1f} s",
                  flush=True)
            del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return str(target), str(draft)


def draft_command(a: argparse.Namespace, model: str | None, flag: list[str]) -> list[str]:
    args = ["draft", "--method", a.method, "--port", "0", "--device", a.device,
            "--max-sequences", "256", *flag, *(["--model", model] if model else []),
            *(["--target-embeddings", a.model] if a.method in ("eagle3", "dflash") else [])]
    return pinned(1, *args) if a.device == "cpu" else cli_command(*args)


def verify_command(a: argparse.Namespace, model: str, draft: str, flag: list[str]) -> list[str]:
    if a.device != "cpu":
        return verify_argv(model, a.device, draft, a.conversations,
                           (*flag, "--speculation", a.speculation))
    return pinned(0, "verify", "--model", model, "--draft", draft, "--port", "0", "--device",
                  "cpu", "--speculation", a.speculation, "--metrics-port", "0",
                  "--step-deadline-ms", "10000", "--max-batch", str(a.conversations), *flag)


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


def warm_up(c: TreespecClient, a: argparse.Namespace) -> None:
    """Both services once; on a GPU also the run's prefill lengths, full and after a hit
    (kernels compile at first use), with tokens of their own."""
    conversation(c, [7] * 40, [[8] * 8], 8)
    if a.device != "cpu":
        g = random.Random(1)
        conversation(c, random_ids(g, a.system_tokens), [random_ids(g, a.user_tokens)] * 2, 8)


def one_setting(a: argparse.Namespace, cache: bool, target: str, draft_model: str | None,
                chat: Chat) -> tuple[dict, list]:
    system, users = chat
    flag = [] if cache else ["--no-prefix-caching"]
    cpu = a.device == "cpu"
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} if cpu else None
    up = 180 if cpu else 600
    with start("draft", draft_command(a, draft_model, flag), up, env) as draft, start(
            "verify", verify_command(a, target, draft.addr, flag), up, env) as verify:
        url = metrics_url(verify)
        with TreespecClient(verify.addr, timeout=1200) as c:
            c.wait_ready(up)
            while not c.info().draft_connected:
                time.sleep(0.1)
            warm_up(c, a)
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
        "acceptance": sum(r["stats"]["accepted_tokens"] for r in turns)
        / max(1, sum(r["stats"]["draft_tokens"] for r in turns)),
        "prefix_cache_queries": after.get("queries", 0) - before.get("queries", 0),
        "prefix_cache_hits": after.get("hits", 0) - before.get("hits", 0),
    }
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
          flush=True)
    return row, [[r["ids"] for r in conv] for conv in convs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny-code", help="without --target-shape")
    ap.add_argument("--method", default="model")
    ap.add_argument("--device", default="cpu", help="cpu (services pinned) or cuda, cuda:1, ...")
    ap.add_argument("--target-shape", choices=list(shapes.SHAPES),
                    help="random checkpoints of this target shape instead of --model")
    ap.add_argument("--draft-shape", choices=list(shapes.SHAPES), default="qwen3-0.6b")
    ap.add_argument("--work", default="/tmp/treespec-prefix-cache",
                    help="where --target-shape's checkpoints are written (kept: reused)")
    ap.add_argument("--plant", action="store_true",
                    help="--target-shape: plant a successor map in the target (wide greedy "
                         "margins); default plain random weights")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--speculation", default="always", choices=["always", "adaptive"],
                    help="the verify's: always (tokens per step measure the drafter) or "
                         "adaptive (the default users run: a draft never accepted stops "
                         "costing steps)")
    a = ap.parse_args()
    if a.target_shape and a.method != "model":
        ap.error("--target-shape builds a draft model: --method model")
    if a.target_shape:
        target, draft = checkpoints(a)
        chat, models = random_chat(a), {
            "target": f"random {a.target_shape}", "draft": f"random {a.draft_shape}",
            "planted_successor_map": a.plant, "prompts": "random token ids"}
    else:
        target, draft = str(resolve_model(a.model)), SHIPPED_DRAFTS.get(a.method)
        chat, models = held_out_chat(a), {"target": a.model, "draft": draft,
                                          "prompts": "held-out text"}
    device = "cpu" if a.device == "cpu" else torch.cuda.get_device_name(torch.device(a.device))
    rows, outputs = [], []
    for cache in (True, False):
        row, out = one_setting(a, cache, target, draft, chat)
        rows.append(row)
        outputs.append(out)
    on, off = rows
    summary = {"identical": outputs[0] == outputs[1],
               "ttft_later_median_x": off["ttft_later_median_s"] / on["ttft_later_median_s"],
               "tok_s_x": on["tok_s"] / off["tok_s"]}
    print(json.dumps(summary), flush=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "device": device, **models,
                                       "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
