"""Does each same-host transport mechanism pay? Every one on vs off, side by side.

    python bench/transport_ab.py --out ab.json [--variants default,socket,...] [--budget-s 540]

Both services run as CLI processes; for each variant one verify service (Qwen3-8B
shape, planted) serves two drafts in turn on one fixed port: the replay instrument
(`--accept 3`, 4 tokens a step) and the draft-model proposer (Qwen3-0.6B shape,
random weights, chain4). Each (proposer, batch) row is three timed runs after a
warm-up; the median and the spread are kept. Plain decode (speculation off) runs
first with the verify's defaults and with its busy polling off; its outputs are the
replay's reference, and every speculative output must equal them.

A mechanism earns its place where, in some row, `on` beats `off` by at least 2 %
plus the larger relative spread of the two variants' repeats (the `verdict` rows).
`--target-shape tiny --draft-shape tiny --device cpu` smoke-tests the script here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import shapes  # noqa: E402
from bench.e2e_bench import carrier_of, first_divergence, start, throughput, verify_argv  # noqa: E402
from bench.step_metrics import metrics_url  # noqa: E402
from common.client import AsyncTreespecClient  # noqa: E402
from common.launch import cli_command  # noqa: E402

BENCH = Path(__file__).resolve().parent

# the verify service with busy polling on but each step run in its worker thread
# instead of launched from the loop and polled (the mechanism has no flag of its own)
_NO_EVENT_POLL = ("import sys, verify_service.step_runner as s\n"
                  "init = s.StepRunner.__init__\n"
                  "def patched(self, *a, **k):\n"
                  "    init(self, *a, **k)\n"
                  "    self.poll_device = False\n"
                  "s.StepRunner.__init__ = patched\n"
                  "from common.cli import main\n"
                  "sys.exit(main(sys.argv[1:]))\n")

OFF = ("--busy-poll", "off")
# name -> (what differs, environment, draft's extra flags, verify's extra flags)
VARIANTS: dict[str, tuple[str, dict[str, str], tuple[str, ...], tuple[str, ...]]] = {
    "default": ("every mechanism on (the defaults): mailbox on the local socket, both "
                "loops spinning with rehearsal and the quiet wait, event polling", {}, (), ()),
    "socket": ("the local socket without its mailbox", {}, (), ("--draft-socket", "socket")),
    "grpc": ("the gRPC stream (no local socket)", {}, (), ("--draft-socket", "off")),
    "norehearse": ("no rehearsal on either side", {}, ("--rehearse", "off"),
                   ("--rehearse", "off")),
    "loudspin": ("no quiet wait: both loops poll epoll at every turn",
                 {"TREESPEC_SPIN_QUIET_US": "0"}, (), ()),
    "draftsleep": ("the draft's loop sleeps (no draft-side spinning)", {}, OFF, ()),
    "noeventpoll": ("the verify steps in its worker thread (no launch-and-poll from the "
                    "loop); busy polling otherwise on", {}, (), ()),
    "verifysleep": ("the verify's loop sleeps (no busy or event polling), socket alone",
                    {}, (), (*OFF, "--draft-socket", "socket")),
    "bare": ("nothing: gRPC stream, both loops sleep", {}, OFF, (*OFF, "--draft-socket", "off")),
}
# mechanism -> (variant with it, variant without it)
COMPARE = {
    "mailbox (vs the socket alone)": ("default", "socket"),
    "rehearsal": ("default", "norehearse"),
    "quiet wait": ("default", "loudspin"),
    "draft-side spinning": ("default", "draftsleep"),
    "verify event polling": ("default", "noeventpoll"),
    "verify busy polling (socket)": ("socket", "verifysleep"),
    "socket (vs the gRPC stream)": ("socket", "grpc"),
    "spinning at all (gRPC stream)": ("grpc", "bare"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def draft_argv(proposer: str, port: int, extra: tuple[str, ...], cont: Path, draft: str,
               device: str) -> list[str]:
    if proposer == "replay":
        return [sys.executable, str(BENCH / "replay.py"), "--continuations", str(cont),
                "--accept", "3", "--port", str(port), *extra]
    return cli_command("draft", "--method", "model", "--model", draft, "--envelope", "chain4",
                       "--port", str(port), "--device", device, *extra)


async def _wait_for(addr: str, proposer: str, timeout: float = 120.0) -> None:
    """Until the verify service reports this proposer connected."""
    async with AsyncTreespecClient(addr) as c:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            info = await c.info()
            if info.draft_connected and info.proposer == proposer:
                return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"the verify service never reported draft {proposer!r} connected")


def summary(r: dict) -> dict:
    runs = r.get("tok_s_runs", [r["tok_s"]])
    keep = ("tok_s", "step_ms", "hop_ms", "verify_ms", "hop_send_ms", "hop_to_draft_ms",
            "hop_draft_ms", "hop_to_verify_ms", "hop_read_ms", "prefill_ms",
            "tokens_per_step", "fallback_steps")
    return {**{k: r[k] for k in keep if k in r}, "tok_s_runs": runs,
            "spread": (max(runs) - min(runs)) / r["tok_s"]}


def run_variant(name: str, target: str, draft: str, device: str, sets: dict, plain: dict,
                max_tokens: int, cont: Path, reps: int) -> dict:
    _, env, d_extra, v_extra = VARIANTS[name]
    port = free_port()
    argv = verify_argv(target, device, f"127.0.0.1:{port}", max(sets), v_extra)
    if name == "noeventpoll":
        argv = [argv[0], "-c", _NO_EVENT_POLL, *argv[3:]]      # argv: python -m common.cli
    v = start(f"verify-{name}", argv, env=env)
    out: dict = {}
    try:
        for proposer, label in (("replay", "replay-instrument"), ("model", "model")):
            d = start(f"{proposer}-{name}", draft_argv(proposer, port, d_extra, cont, draft,
                                                       device), env=env)
            try:
                asyncio.run(_wait_for(v.addr, label))
                for b, prompts in sets.items():
                    r = throughput(v.addr, prompts, max_tokens, no_spec=False,
                                   metrics=metrics_url(v), reps=reps)
                    ids = r.pop("ids")
                    row = summary(r)
                    row["lossless"] = all(f is None for f in first_divergence(ids, plain[b])) \
                        and r.get("runs_agree", True)
                    row["carrier"] = carrier_of(v)
                    out[f"{proposer}_b{b}"] = row
                    print(f"{name:12s} {proposer:6s} b={b:<3d} {row['tok_s']:8.1f} tok/s "
                          f"(runs {', '.join(f'{x:.1f}' for x in row['tok_s_runs'])}) "
                          f"hop {row.get('hop_ms', 0):.3f} ms step {row.get('step_ms', 0):.2f} "
                          f"ms, fallbacks {row.get('fallback_steps')}, {row['carrier']}, "
                          f"lossless {row['lossless']}", flush=True)
            finally:
                d.stop()
    finally:
        v.stop()
    return out


def verdicts(res: dict) -> list[dict]:
    """Per mechanism and row: what `on` buys over `off`, the noise, and whether it pays."""
    tables = dict(res["variants"])
    for tag in ("plain", "plain_nopoll"):      # plain decode as two more variants
        tables[tag] = {k[len(tag) + 1:]: v for k, v in res["plain"].items()
                       if re.fullmatch(tag + r"_b\d+", k)}
    rows = []
    for mech, (on, off) in {**COMPARE, "verify busy polling (plain decode)":
                            ("plain", "plain_nopoll")}.items():
        a, b = tables.get(on, {}), tables.get(off, {})
        for k in [k for k in a if k in b and k != "error"]:
            x, y = a[k], b[k]
            buys = x["tok_s"] / y["tok_s"] - 1
            noise = max(x["spread"], y["spread"])
            rows.append({"mechanism": mech, "row": k, "on": x["tok_s"], "off": y["tok_s"],
                         "buys": buys, "noise": noise, "pays": buys >= 0.02 + noise})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/treespec-ab")
    ap.add_argument("--target-shape", default="qwen3-8b")
    ap.add_argument("--draft-shape", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--plain", default="on", choices=["on", "off", "reuse"],
                    help="off: plain decode with the defaults only; reuse: the outputs of "
                         "an earlier run in --work, if any (no plain rows then)")
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="start no variant after this many seconds (results are saved as "
                         "each variant ends)")
    a = ap.parse_args()
    t0 = time.monotonic()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    target, draft = work / f"target-{a.target_shape}", work / f"draft-{a.draft_shape}"
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "target": a.target_shape,
                 "draft": a.draft_shape, "ctx": a.ctx, "max_tokens": a.max_tokens,
                 "reps": a.reps, "variants_described": {k: v[0] for k, v in VARIANTS.items()},
                 "plain": {}, "variants": {}, "skipped": []}
    out = Path(a.out)

    def save() -> None:
        res["verdicts"] = verdicts(res)
        out.write_text(json.dumps(res, indent=1))

    import torch
    for name, path, kw in ((a.target_shape, target, {"plant": a.target_shape != "tiny"}),
                           (a.draft_shape, draft, {"seed": 2})):
        if not (path / "config.json").exists():
            m = shapes.random_hf_model(name, a.device, **kw)
            shapes.save_checkpoint(m, path)
            del m
            if a.device == "cuda":
                torch.cuda.empty_cache()
    res["checkpoints_s"] = time.monotonic() - t0
    batches = [int(x) for x in a.batches.split(",")]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 151936, (a.ctx,), generator=g).tolist()
               for _ in range(sum(batches))]
    sets, at = {}, 0
    for b in batches:
        sets[b], at = prompts[at:at + b], at + b
    # plain decode: the baseline and the replay's reference (equal to the verify path's
    # own greedy output on the planted target: bench/NOTES.md, eighth session)
    plain: dict[int, list[list[int]]] = {}
    cached = work / f"plain-{a.ctx}-{a.max_tokens}-{a.batches}.json"
    if a.plain == "reuse" and cached.exists():     # an earlier call on this machine
        plain = {int(k): v for k, v in json.loads(cached.read_text()).items()}
    for tag, extra in (("plain", ()), ("plain_nopoll", OFF)):
        if plain and (a.plain == "reuse" or tag == "plain_nopoll" and a.plain == "off"):
            continue
        v = start(tag, verify_argv(str(target), a.device, None, max(batches), extra))
        try:
            for b in batches:
                r = throughput(v.addr, sets[b], a.max_tokens, no_spec=True,
                               metrics=metrics_url(v), reps=a.reps)
                ids = r.pop("ids")
                if tag == "plain":
                    plain[b] = ids
                row = summary(r)
                row["lossless"] = ids == plain[b]
                res["plain"][f"{tag}_b{b}"] = row
                print(f"{tag:12s} b={b:<3d} {row['tok_s']:8.1f} tok/s (runs "
                      f"{', '.join(f'{x:.1f}' for x in row['tok_s_runs'])})", flush=True)
        finally:
            v.stop()
    res["plain_s"] = time.monotonic() - t0
    cached.write_text(json.dumps(plain))
    cont = work / "continuations.json"
    cont.write_text(json.dumps([{"prompt": p, "continuation": c} for b in sets
                                for p, c in zip(sets[b], plain[b])]))
    save()
    for name in a.variants.split(","):
        if time.monotonic() - t0 > a.budget_s:
            res["skipped"].append(name)
            continue
        t1 = time.monotonic()
        try:
            res["variants"][name] = run_variant(name, str(target), str(draft), a.device, sets,
                                                plain, a.max_tokens, cont, a.reps)
        except Exception as e:            # one broken variant must not cost the others
            res["variants"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: {res['variants'][name]['error']}", flush=True)
        res.setdefault("variant_s", {})[name] = time.monotonic() - t1
        save()
    save()
    print("\n| mechanism | row | on | off | buys | noise | pays |")
    for r in res["verdicts"]:
        print(f"| {r['mechanism']} | {r['row']} | {r['on']:.1f} | {r['off']:.1f} | "
              f"{100 * r['buys']:+.1f} % | {100 * r['noise']:.1f} % | "
              f"{'yes' if r['pays'] else 'no'} |")
    print("skipped:", res["skipped"], "total s:", round(time.monotonic() - t0))


if __name__ == "__main__":
    main()
