"""What each real drafter costs and buys at serving load, through both services.

    python bench/drafters.py --out bench/results/drafters.json [--batches 1,8,32,64]
        [--configs ngram:chain4,model:tree-small,...] [--modes random,shadow]

One verify service (Qwen3-8B shape, random weights; --plant: a planted successor map)
serves every draft in turn on one port; per (proposer, envelope, mode) a draft service
starts: `treespec draft` with random weights (mode random: what the drafter costs,
accepting almost nothing; the draft model is Qwen3-0.6B-shaped, the EAGLE-3 head the
published Qwen3-8B one's shape with the target's embeddings; random+laK: with
--lookahead K), or the shadow replay instrument (mode shadow; shadow+laK@H: with the
drafter's own lookahead for its cost, the step's outcome among the candidates with
probability H, default 1:
the same drafter's whole step, its tree then replaced by the replay's continuation at
3 correct tokens of 4: what it buys at 4 tokens a step; mode shadowraw: the same with
the hidden states crossing unprojected, the projection's side-by-side). Plain decode
runs first in the same verify service (speculation off), and again after the last row;
its outputs are the reference every speculative output must equal, and each row's
ratio is over the mean of the two plain passes (`plain_again`: their drift is the run's
noise floor). Both services run as CLI processes on their defaults, but for the
verify's --max-batch and both services' --num-blocks (64 sequences of 1024 + 256
tokens). Per row: tok/s, its ratio to plain, the step, the draft's part of it, and
plain-decode steps by reason. `--target-shape tiny --draft-shape tiny --device cpu`
runs the whole path on a CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path


import shapes
from e2e_bench import first_divergence, start, throughput
from step_metrics import fallback_counts, metrics_url, totals
from bench_accept import envelope_args
from treespec.common.client import AsyncTreespecClient
from treespec.common.serving.launch import cli_command

BENCH = Path(__file__).resolve().parent
# EAGLE-3's hidden states crossing the hop, and the hops that carried them
HIDDEN = ("treespec:draft_hidden_state_bytes_total", "treespec:draft_hop_seconds_count")
# the draft service's own: its engine's step (updates, propose, trees) and the propose
DRAFT = ("treespec:draft_step_seconds_sum", "treespec:draft_step_seconds_count",
         "treespec:draft_propose_seconds_sum")
# what a plain run keeps: tok/s, the step and its forward (ms), the forward's tail
PLAIN_KEYS = ("tok_s", "step_ms", "verify_ms", "step_over_ms", "verify_over_ms")
CONFIGS = ("ngram:chain4,ngram:tree-small,model:chain4,model:tree-small,"
           "eagle3:chain4,eagle3:tree-small")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def draft_argv(method: str, envelope: str, mode: str, port: int, work: Path, target: Path,
               device: str, cont: Path, pages: int, accept: int = 3) -> list[str]:
    model = {"ngram": [], "model": ["--model", str(work / "draft")],
             "eagle3": ["--model", str(work / "eagle3"), "--target-embeddings", str(target)],
             "dflash": ["--model", str(work / "dflash"), "--target-embeddings", str(target)]}
    common = [*envelope_args(envelope), "--port", str(port), "--num-blocks", str(pages),
              "--metrics-port", "0", *model[method]]
    mode, _, ahead = mode.partition("+la")          # random+la1: the draft's --lookahead 1
    ahead, _, hit_rate = ahead.partition("@")       # shadow+la1@0.15: the replay's hit rate
    if ahead:
        common += ["--lookahead", ahead]
    if mode == "random":
        return cli_command("draft", "--method", method, "--device", device, *common)
    raw = ["--raw-hidden"] if mode == "shadowraw" else []     # the A/B of the projection
    hit = ["--hit-rate", hit_rate] if hit_rate else []
    return [sys.executable, str(BENCH / "replay.py"), "--continuations", str(cont),
            "--accept", str(accept), "--shadow", method, "--device", device, *raw, *hit,
            *common]


async def _connected(addr: str, proposer: str, timeout: float = 600.0) -> None:
    async with AsyncTreespecClient(addr) as c:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            info = await c.info()
            if info.draft_connected and info.proposer == proposer:
                return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"the verify service never reported draft {proposer!r} connected")


def row(r: dict, ids: list[list[int]], plain: dict, before: dict, after: dict) -> dict:
    keep = ("tok_s", "tokens_per_step", "step_ms", "hop_ms", "hop_draft_ms", "verify_ms",
            "prefill_ms", "fallback_steps", "tok_s_runs", "step_over_ms", "hop_over_ms",
            "verify_over_ms", "budget_steps", "budget_step_ms", "lookahead_hits",
            "lookahead_misses")
    return {**{k: r[k] for k in keep if k in r},
            "over_plain": r["tok_s"] / plain["tok_s"],
            "fallbacks": {k: v - before.get(k, 0.0) for k, v in after.items()
                          if v - before.get(k, 0.0)},
            "lossless": all(f is None for f in first_divergence(ids, plain["ids"]))}


def pages(a: argparse.Namespace) -> int:
    """KV pages (both services) for the largest batch's sequences: what the verify reserves
    for one while no draft is connected (prompt, new tokens, 64 tree nodes and a root,
    16 tokens a page) and its scratch page; one page short, a sequence waits a whole
    generation (the b64 plain rows before the sixteenth session)."""
    per = -(-(a.ctx + a.max_tokens + 65) // 16)
    return max(4096, max(int(b) for b in a.batches.split(",")) * per + 1)


def checkpoints(a: argparse.Namespace, work: Path) -> None:
    import torch
    made = [(target_name(a), lambda: shapes.random_hf_model(a.target_shape, a.device,
                                                             plant=planted(a))),
            ("draft", lambda: shapes.random_hf_model(a.draft_shape, a.device, seed=2))]
    for name, make in made:
        if not (work / name / "config.json").exists():
            m = make()
            shapes.save_checkpoint(m, work / name)
            del m
            if a.device == "cuda":
                torch.cuda.empty_cache()
    if not (work / "eagle3" / "config.json").exists():
        shapes.random_eagle3_head(a.target_shape, work / "eagle3")
    if not (work / "dflash" / "config.json").exists():
        shapes.random_dflash(a.target_shape, work / "dflash", a.device)


def planted(a: argparse.Namespace) -> bool:
    """Whether the target carries a planted successor map (--plant; never the tiny shape)."""
    return a.target_shape != "tiny" and a.plant


def target_name(a: argparse.Namespace) -> str:
    """The target checkpoint's folder under --work (planted and plain random weights apart)."""
    return "target-planted" if planted(a) else "target"


def sampling(a: argparse.Namespace) -> dict | None:
    """The requests' sampling fields (None: greedy)."""
    return {"temperature": a.temperature, "top_k": 20, "top_p": 0.95} if a.temperature else None


def shape_args(description: str) -> argparse.ArgumentParser:
    """The flags this benchmark and bench/drafter_step.py share."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/treespec-drafters")
    ap.add_argument("--target-shape", default="qwen3-8b")
    ap.add_argument("--draft-shape", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--plant", action="store_true",
                    help="plant a successor map in the target (wide greedy margins: rows equal "
                         "plain decode under any kernels, e.g. --verify-args="
                         "--batch-invariant=off); default plain random weights, near-tied")
    return ap


def main() -> None:
    ap = shape_args(__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--configs", default=CONFIGS,
                    help="proposer:envelope[:shadow accept[:mode]], comma-separated (the "
                         "envelope a preset or DEPTHxTOPKxNODES; a mode given runs that mode "
                         "only; the key gains @accept)")
    ap.add_argument("--modes", default="random,shadow")
    ap.add_argument("--shadow-accept", type=int, default=3,
                    help="draft tokens the shadow replay has accepted a step (3: 4 tokens a step)")
    ap.add_argument("--verify-args", default="", help="extra verify flags, space-separated")
    ap.add_argument("--warmup-tokens", type=int, default=32,
                    help="an untimed run of this many tokens before each row's batch: graph "
                         "captures and the controller's first tries are one-offs a serving "
                         "process pays once, not in every 128 tokens")
    ap.add_argument("--reps", type=int, default=1,
                    help="timed runs (odd) of each row at every batch, the median kept (batch 1: "
                         "at least 3); one pass of a b32 plain step spreads by ±5 %%")
    ap.add_argument("--pairs", type=int, default=0,
                    help="then N turns of a plain run (no_speculation, the same services) "
                         "and the row's, back to back, at every batch: over_plain_paired is "
                         "the median turn's ratio, free of the drift between passes minutes "
                         "apart")
    ap.add_argument("--pairs-below", type=float, default=float("inf"),
                    help="pair only the cells whose one pass is under this many times plain "
                         "(1.05: the cells near plain that one pass cannot judge)")
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="start no configuration after this many seconds")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: every request samples (Qwen3's top-k 20, top-p 0.95; prompt i "
                         "seeded i); plain decode's samples are the replay's continuations and, "
                         "under coupled acceptance, what every row must equal")
    a = ap.parse_args()
    import torch
    t0 = time.monotonic()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    checkpoints(a, work)
    batches = [int(x) for x in a.batches.split(",")]
    g = torch.Generator().manual_seed(7)
    sets, at = {}, 0
    prompts = [torch.randint(0, 151936, (a.ctx,), generator=g).tolist()
               for _ in range(sum(batches))]
    for b in batches:
        sets[b], at = prompts[at:at + b], at + b
    out = Path(a.out)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "target": a.target_shape,
                 "draft": a.draft_shape, "ctx": a.ctx, "max_tokens": a.max_tokens,
                 "planted_successor_map": planted(a),
                 "sampling": sampling(a),
                 "plain": {}, "rows": {}, "errors": {}}
    port = free_port()
    v = start("verify", cli_command(
        "verify", "--model", str(work / target_name(a)), "--port", "0", "--device", a.device,
        "--max-batch", str(max(batches)), "--num-blocks", str(pages(a)), "--metrics-port", "0",
        "--draft", f"127.0.0.1:{port}", *a.verify_args.split()))
    try:
        url = metrics_url(v)
        res["plain"] = plain_pass(v.addr, sets, a, url)
        cont = work / "continuations.json"
        cont.write_text(json.dumps([{"prompt": p, "continuation": c} for b in batches
                                    for p, c in zip(sets[b], res["plain"][str(b)]["ids"])]))
        for config in a.configs.split(","):
            method, envelope, *rest = config.split(":")
            accept = int(rest[0]) if rest and rest[0] else a.shadow_accept
            for mode in rest[1:] or a.modes.split(","):
                key = f"{method}:{envelope}:{mode}" + (f"@{rest[0]}" if rest and rest[0] else "")
                if time.monotonic() - t0 > a.budget_s:
                    res.setdefault("skipped", []).append(key)
                    continue
                try:
                    res["rows"][key] = run_config(key, method, envelope, mode, port, work, a,
                                                  v, url, sets, res["plain"], cont, accept)
                except Exception as e:    # one broken configuration must not cost the rest
                    res["errors"][key] = f"{type(e).__name__}: {e}"
                    print(f"{key}: {res['errors'][key]}", flush=True)
                out.write_text(json.dumps(strip(res), indent=1))
        # plain decode again at the end: rows are over the mean of both passes
        res["plain_again"] = plain_pass(v.addr, sets, a, url, "plain again")
        for b, p in res["plain_again"].items():
            first = res["plain"][b]
            p["lossless"] = all(f is None for f in first_divergence(p["ids"], first["ids"]))
            for rows in res["rows"].values():
                if b in rows:
                    rows[b]["over_plain"] = 2 * rows[b]["tok_s"] / (first["tok_s"] + p["tok_s"])
    finally:
        v.stop()
        (work / "verify.log").write_text(v.output())
    out.write_text(json.dumps(strip(res), indent=1))
    plot(res, out.with_suffix(".png"))
    print("total s:", round(time.monotonic() - t0))


def reps(a: argparse.Namespace, b: int) -> int:
    """Timed runs of a batch (the median is kept): --reps, and at least 3 at batch 1."""
    return max(a.reps, 3 if b == 1 else 1)


def plain_pass(addr: str, sets: dict, a: argparse.Namespace, url: str | None,
               label: str = "plain") -> dict:
    """Plain decode (no_speculation) at every batch: tok/s, the step and its forward (ms:
    the speculative rows' plain steps compare with these) and the token ids."""
    res = {}
    for b, prompts in sets.items():
        r = throughput(addr, prompts, a.max_tokens, no_spec=True, metrics=url,
                       reps=reps(a, b), warmup=a.warmup_tokens,
                       sampling=sampling(a))
        res[str(b)] = {**{k: r[k] for k in PLAIN_KEYS if k in r},
                       "ids": r["ids"]}
        print(f"{label} b={b}: {r['tok_s']:.1f} tok/s", flush=True)
    return res


def run_config(key: str, method: str, envelope: str, mode: str, port: int, work: Path,
               a: argparse.Namespace, v, url: str | None, sets: dict, plain: dict,
               cont: Path, accept: int) -> dict:
    proposer = method if mode.startswith("random") else f"shadow-replay-instrument:{method}"
    d = start(f"{method}-{envelope}-{mode}",
              draft_argv(method, envelope, mode, port, work, work / target_name(a), a.device,
                         cont, pages(a), accept))
    rows: dict = {}
    try:
        asyncio.run(_connected(v.addr, proposer))
        durl = metrics_url(d)
        for b, prompts in sets.items():
            before, bytes0, draft0 = fallback_counts(url), totals(url, HIDDEN), totals(durl, DRAFT)
            r = throughput(v.addr, prompts, a.max_tokens, no_spec=False, metrics=url,
                           reps=reps(a, b), warmup=a.warmup_tokens,
                           sampling=sampling(a))
            rows[str(b)] = row(r, r.pop("ids"), plain[str(b)], before, fallback_counts(url))
            if url is not None:             # bytes of hidden states per drafted step
                got = {k: v - bytes0[k] for k, v in totals(url, HIDDEN).items()}
                rows[str(b)]["hidden_bytes_per_step"] = got[HIDDEN[0]] / max(1.0, got[HIDDEN[1]])
            if durl is not None:            # the draft's part of a hop: its engine, its propose
                got = {k: v - draft0[k] for k, v in totals(durl, DRAFT).items()}
                n = max(1.0, got[DRAFT[1]])
                rows[str(b)]["draft_engine_ms"] = 1000 * got[DRAFT[0]] / n
                rows[str(b)]["draft_propose_ms"] = 1000 * got[DRAFT[2]] / n
            x = rows[str(b)]
            if a.pairs and x["over_plain"] < a.pairs_below:
                x["paired_turns"], x["paired_plain"] = paired(v.addr, prompts, a, url)
                x["over_plain_paired"] = sorted(x["paired_turns"])[a.pairs // 2]
            print(f"{key} b={b}: {x['tok_s']:.1f} tok/s ({x['over_plain']:.2f} x), step "
                  f"{x.get('step_ms', 0):.2f} ms, draft {x.get('hop_draft_ms', 0):.2f} ms, "
                  f"fallbacks {x['fallbacks']}, lossless {x['lossless']}"
                  + (f", paired {x['over_plain_paired']:.3f} x" if "paired_turns" in x else ""),
                  flush=True)
    finally:
        d.stop()
        (work / f"{method}-{envelope}-{mode}.log").write_text(d.output())
    return rows


def paired(addr: str, prompts: list[list[int]], a: argparse.Namespace, url: str | None
           ) -> tuple[list[float], list[dict]]:
    """Each of a.pairs turns' tok/s of the row over plain's, a turn one run of plain
    decode then one of the row, back to back (both warm already): their spread is the
    noise a judgement of the median is inside; and each turn's plain run (tok/s, step and
    forward ms), plain decode with the row's draft attached, to set beside the plain
    passes without one."""
    ratios, plains = [], []
    for _ in range(a.pairs):
        p, r = (throughput(addr, prompts, a.max_tokens, no_spec=plain, warmup=0,
                           metrics=url if plain else None, sampling=sampling(a))
                for plain in (True, False))
        ratios.append(r["tok_s"] / p["tok_s"])
        plains.append({k: p[k] for k in PLAIN_KEYS if k in p})
    return ratios, plains


def strip(res: dict) -> dict:
    """res without the reference token ids (they only serve the lossless check)."""
    return {**res, **{key: {b: {k: v for k, v in p.items() if k != "ids"}
                            for b, p in res[key].items()}
                      for key in ("plain", "plain_again") if key in res}}


def plot(res: dict, path: Path) -> None:
    """tok/s against batch size for plain and every row (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot", flush=True)
        return
    fig, ax = plt.subplots(figsize=(9, 6))
    bs = sorted(int(b) for b in res["plain"])
    ax.plot(bs, [res["plain"][str(b)]["tok_s"] for b in bs], "k-o", lw=2, label="plain")
    for key, rows in res["rows"].items():
        xs = sorted(int(b) for b in rows)
        style = "--" if ":random" in key else "-"
        ax.plot(xs, [rows[str(b)]["tok_s"] for b in xs], style, marker=".", label=key)
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel(f"batch (concurrent {res['ctx']}-token prompts)")
    ax.set_ylabel("tok/s, end to end")
    ax.set_title(f"{res['target']} target on one GPU ({res['date']}); "
                 "random: drafter cost; shadow@k: replay instrument, k+1 tok/step")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
