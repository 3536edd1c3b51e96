"""End-to-end measurements through both real services on loopback (CLI processes)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections.abc import Collection
from pathlib import Path

from step_metrics import metrics_url, step_breakdown, step_sums
from treespec.common.client import AsyncTreespecClient
from treespec.common.serving.launch import ServiceProcess, child_env, cli_command, start_process

BENCH = Path(__file__).resolve().parent


def start(name: str, argv: list[str], timeout: float = 600,
          env: dict[str, str] | None = None) -> ServiceProcess:
    """A service process; env adds variables. One that does not come up is stopped."""
    return start_process(name, argv, timeout, child_env(env))


def verify_argv(model: str, device: str, draft: str | None, max_batch: int,
                extra: tuple[str, ...] = ()) -> list[str]:
    # every step speculates: the instruments measure the speculative path at a set
    # acceptance; what the controller chooses is bench/drafters.py's to measure
    argv = cli_command("verify", "--model", model, "--port", "0", "--device", device,
                       "--max-batch", str(max_batch), "--num-blocks", "6000",
                       "--step-deadline-ms", "2000", "--metrics-port", "0",
                       "--speculation", "always", *extra)
    return argv + (["--draft", draft] if draft else [])


async def _batch(addr: str, prompts: list[list[int]], max_tokens: int, no_spec: bool,
                 reps: int, mark, warmup: int = 8, sampling: dict | None = None
                 ) -> list[tuple[float, list[dict], list[list[int]]]]:
    """reps timed runs of the batch after one warm-up of warmup tokens (0: none); mark() before
    each and after the last. sampling: the requests' sampling fields, prompt i seeded i."""
    runs = []

    def args(i: int) -> dict:
        return {**sampling, "seed": i} if sampling else {}

    async with AsyncTreespecClient(addr, timeout=600) as c:
        await c.wait_ready(600)
        if warmup:          # captures this batch bucket's graphs
            await asyncio.gather(*[c.generate(prompt_ids=p, max_tokens=warmup,
                                              ignore_eos=True, no_speculation=no_spec,
                                              **args(i))
                                   for i, p in enumerate(prompts)])
        for _ in range(reps):
            mark()
            t0 = time.perf_counter()
            outs = await asyncio.gather(*[c.generate(prompt_ids=p, max_tokens=max_tokens,
                                                     ignore_eos=True, no_speculation=no_spec,
                                                     **args(i))
                                          for i, p in enumerate(prompts)])
            runs.append((time.perf_counter() - t0, [o.stats for o in outs],
                         [o.token_ids for o in outs]))
        mark()
    return runs


def throughput(addr: str, prompts: list[list[int]], max_tokens: int, no_spec: bool,
               metrics: str | None = None, reps: int = 1, warmup: int = 8,
               sampling: dict | None = None) -> dict:
    """The batch's figures over one timed run, or over the median (by tok/s) of reps
    runs, with every run's tok/s under tok_s_runs; after an untimed warm-up run of
    warmup tokens. sampling: as _batch's."""
    marks: list[dict] = []

    def mark() -> None:
        marks.append(step_sums(metrics))

    runs = asyncio.run(_batch(addr, prompts, max_tokens, no_spec, reps, mark, warmup,
                             sampling))
    rates = [sum(s["completion_tokens"] for s in st) / dt for dt, st, _ in runs]
    i = sorted(range(reps), key=rates.__getitem__)[reps // 2]
    (dt, stats, ids), before, after = runs[i], marks[i], marks[i + 1]
    gen = sum(s["completion_tokens"] for s in stats)
    steps = sum(s["steps"] for s in stats)
    # the prefill's token is not a step's: leave it out of tokens per step
    per_step = (gen - len(stats)) / max(1, steps)
    parts = step_breakdown(before, after) if metrics is not None else {}
    if "step_ms" in parts:      # the decode phase alone: what a step commits over what it costs
        parts["decode_tok_s"] = 1000 * per_step * len(prompts) / parts["step_ms"]
    return {"tok_s": gen / dt, "tokens_per_step": per_step, "seconds": dt, **parts,
            "accepted": sum(s["accepted_tokens"] for s in stats),
            "drafted": sum(s["draft_tokens"] for s in stats),
            "fallback_steps": sum(s["fallback_steps"] for s in stats), "ids": ids,
            **({"tok_s_runs": rates, "runs_agree": all(r[2] == ids for r in runs)}
               if reps > 1 else {})}


def carrier_of(verify: ServiceProcess) -> str | None:
    """How the verify service's draft steps travel, from its `steps by ...` log line."""
    found = re.findall(r"steps by (.+)", verify.output())
    return found[-1].strip() if found else None


def placement_devices(placement: str, device: str) -> tuple[str, str]:
    """(draft device, verify device): both on `device`, or draft on cuda:0 and
    verify on cuda:1 (issue 6's split; needs two visible GPUs)."""
    if placement == "same":
        return device, device
    if placement == "split":
        return "cuda:0", "cuda:1"
    raise ValueError(f"placement must be same or split, got {placement!r}")


def first_divergence(ids: list[list[int]], refs: list[list[int]]) -> list[int | None]:
    """Per sequence, the first position where ids leave refs (None: never)."""
    return [next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), None)
            for o, r in zip(ids, refs)]


def replay_phase(target: str, device: str, work: Path, label: str, drafting: tuple[str, ...],
                 sets: dict[int, list[list[int]]], max_tokens: int,
                 refs: dict[int, list[list[int]]], plain: dict[int, list[list[int]]],
                 res: dict, verify_extra: tuple[str, ...] = (),
                 reps: dict[int, int] | None = None) -> dict[int, list[list[int]]]:
    """Both services with the replay instrument proposing refs (drafting: its
    --corrupt / --accept flags); returns the outputs. reps: timed runs by batch size
    (the median's figures are kept; default one)."""
    cont = work / f"{label}_continuations.json"
    cont.write_text(json.dumps([{"prompt": p, "continuation": c} for b in sets
                                for p, c in zip(sets[b], refs[b])]))
    outs: dict[int, list[list[int]]] = {}
    with start(f"{label}-draft", [sys.executable, str(BENCH / "replay.py"), "--continuations",
                                  str(cont), *drafting, "--port", "0"]) as d, \
            start("verify", verify_argv(target, device, d.addr, max(sets), verify_extra)) as v:
        for b, prompts in sets.items():
            r = throughput(v.addr, prompts, max_tokens, no_spec=False, metrics=metrics_url(v),
                           reps=(reps or {}).get(b, 1))
            outs[b] = r.pop("ids")
            vs_ref, vs_plain = first_divergence(outs[b], refs[b]), first_divergence(outs[b], plain[b])
            res[f"{label}_b{b}"] = dict(
                r, lossless=all(f is None for f in vs_plain) and r.get("runs_agree", True),
                first_divergence=vs_plain,
                identical_to_reference=all(f is None for f in vs_ref),
                reference_divergence=vs_ref, carrier=carrier_of(v))
            print(f"{label} b={b}: {r['tok_s']:.1f} tok/s, {r['tokens_per_step']:.2f} tok/step,"
                  f" equal to plain decode: {res[f'{label}_b{b}']['lossless']}, to its "
                  f"reference: {res[f'{label}_b{b}']['identical_to_reference']}"
                  + (f", lookahead hits {r.get('lookahead_hits', 0):.0f} misses "
                     f"{r.get('lookahead_misses', 0):.0f}" if "--lookahead" in drafting else ""),
                  flush=True)
    return outs


def model_phase(target: str, draft: str, device: str, draft_device: str,
                prompts: list[list[int]], max_tokens: int, max_batch: int,
                verify_flags: tuple[str, ...] = (), hit_rates: Collection[float] = ()) -> dict:
    with start("model-draft", cli_command("draft", "--method", "model", "--model", draft,
                                          "--envelope", "chain4", "--port", "0",
                                          "--device", draft_device)) as d, \
            start("verify", verify_argv(target, device, d.addr, max_batch, verify_flags)) as v:
        r = throughput(v.addr, prompts, max_tokens, no_spec=False, metrics=metrics_url(v))
        r.pop("ids")
        print(f"draft-model b={len(prompts)}: {r['tok_s']:.1f} tok/s, "
              f"{r['tokens_per_step']:.2f} tok/step, {r['fallback_steps']} fallback steps",
              flush=True)
        r["draft_log"], r["verify_log"] = d.output(30), v.output(30)
        if r["fallback_steps"]:
            print("draft service output:\n" + r["draft_log"], flush=True)
            print("verify service output:\n" + r["verify_log"], flush=True)
        return r


# side-by-side variants at the first batch size: key -> (what differs, the verify
# service's extra flags)
AB_VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "grpc": ("replay with draft steps on the gRPC stream (--draft-socket off)",
             ("--draft-socket", "off")),
}


def run_e2e(target: str, draft: str, device: str, prompts: list[list[int]], max_tokens: int,
            batches: list[int], drafting: tuple[str, ...], work: Path,
            placement: str = "same", ab: Collection[str] = (), first_reps: int = 3,
            verify_flags: tuple[str, ...] = (), hit_rates: Collection[float] = (),
            emulated_draft_ms: str = "") -> dict:
    """prompts: at least sum(batches); each batch size gets its own prompts, so each
    replay reference is recorded at the batch shape it is replayed at. drafting: the
    replay instrument's --accept / --corrupt flags. ab: AB_VARIANTS keys, each also run
    at the first batch size, its keys suffixed `_<key>`, for side-by-side comparisons.
    first_reps: timed runs at the first batch size (a 0.2-0.7 s run at batch 1 moves
    with one slow prefill: 27-95 ms on the H200), the median's figures kept.
    verify_flags: every verify service's extra flags (plain and speculative alike).
    hit_rates: each also a replay at every batch size with lookahead (2 candidates) at
    that set hit rate (bench/replay.py --hit-rate), keys `replay_la<h>_b<B>`.
    emulated_draft_ms: "A[,B]": those replays again with the emulated remote draft
    (bench/replay.py --emulated-draft-ms), keys `replay_em_b<B>`, `replay_em_la<h>_b<B>`."""
    res: dict = {"placement": placement}
    reps = {batches[0]: first_reps}
    draft_device, device = placement_devices(placement, device)
    sets, at = {}, 0
    for b in batches:
        sets[b], at = prompts[at:at + b], at + b
    big = max(batches)
    if big > batches[0]:      # the first batch's first prompt also first and last in the largest
        sets[big] = [sets[batches[0]][0], *sets[big][1:-1], sets[batches[0]][0]]
    # 1. plain decode through the verify service (no draft): the baseline.
    v = start("verify", verify_argv(target, device, None, max(batches), verify_flags))
    plain: dict[int, list[list[int]]] = {}
    try:
        for b in batches:
            r = throughput(v.addr, sets[b], max_tokens, no_spec=True, metrics=metrics_url(v),
                           reps=reps.get(b, 1))
            plain[b] = r.pop("ids")
            res[f"plain_b{b}"] = r
            print(f"plain b={b}: {r['tok_s']:.1f} tok/s", flush=True)
    finally:
        v.stop()
    if big > batches[0]:      # plain decode itself batch-invariant: alone (or in the first
        alone = plain[batches[0]][0]            # batch) = first and last among the largest
        res["alone_equals_batch"] = plain[big][0] == alone == plain[big][-1]
        print(f"plain b={batches[0]} first prompt = its copies first and last at b={big}: "
              f"{res['alone_equals_batch']}", flush=True)
    # 2. every drafted token wrong (corrupt 1.0): each token is the bonus of a
    #    [root + 4] verify forward. Its output is the greedy continuation as the
    #    verify path computes it at this batch shape, which the replay proposes in 3:
    #    in bf16 plain decode's [B, 1] forwards round differently and near-tied
    #    argmaxes can flip (bench/divergence.py), after which a continuation
    #    recorded by plain decode would never be accepted again.
    refs = replay_phase(target, device, work, "reject", ("--corrupt", "1.0"), sets, max_tokens,
                        plain, plain, res, verify_extra=verify_flags)
    # 3. replay instrument (chain of 4) at the set tokens per step.
    replay_phase(target, device, work, "replay", drafting, sets, max_tokens, refs, plain, res,
                 verify_extra=verify_flags, reps=reps)
    em = ("--emulated-draft-ms", emulated_draft_ms) if emulated_draft_ms else None
    for label, extra in [("replay_la{h:g}", ()), ("replay_em", em), ("replay_em_la{h:g}", em)]:
        if extra is None:
            continue
        for h in hit_rates if "{h" in label else [None]:
            la = ("--lookahead", "2", "--hit-rate", str(h)) if h is not None else ()
            replay_phase(target, device, work, label.format(h=h), (*drafting, *extra, *la),
                         sets, max_tokens, refs, plain, res, verify_extra=verify_flags,
                         reps=reps)
    b = batches[0]
    for suffix, (_, verify_extra) in AB_VARIANTS.items():
        if suffix not in ab:
            continue
        variant: dict = {}
        replay_phase(target, device, work, "replay", drafting, {b: sets[b]}, max_tokens,
                     {b: refs[b]}, {b: plain[b]}, variant,
                     verify_extra=verify_flags + verify_extra, reps=reps)
        res.update({f"{k}_{suffix}": v for k, v in variant.items()})
    # 4. the draft-model proposer (random weights: acceptance is near zero, so this
    #    measures what a draft costs, not what it buys). Its failure must not cost
    #    the figures above.
    try:
        res["model_b1"] = model_phase(target, draft, device, draft_device, sets[batches[0]],
                                      max_tokens, max(batches), verify_flags)
    except Exception as e:
        res["model_b1"] = {"error": f"{type(e).__name__}: {e}"}
        print("draft-model phase failed:", res["model_b1"]["error"], flush=True)
    return res
