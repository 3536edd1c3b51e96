"""How well each proposer x envelope speculates on held-out Python code.

    python bench/accept.py [--model tiny-code] [--methods ngram,model,eagle3]
        [--envelopes chain4,tree-small,tree-wide] [--files 20] [--prompt-tokens 128]
        [--max-tokens 64] [--temperature T [--top-k K --top-p P --min-p M]]
        [--draft-sampling sample|deterministic] [--acceptance rejection|coupled]
        [--device auto] [--json FILE]

At a temperature above 0 each prompt draws with its own seed (its index), so
"identical" compares speculative and plain output under the same seeds: it must hold
greedy and under coupled acceptance; under rejection sampling the tokens depend on
the drafter (their distribution does not), so it is reported, not required.

For every configuration it starts a real draft service (gRPC on loopback) and a
verify engine in this process, decodes a window of each held-out file, and
reports mean tokens per step (bonus included), acceptance rate by tree depth
(the fraction of steps whose accepted path reached depth d), the target forwards
saved against plain decode, and whether the output equals plain greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.model_paths import SHIPPED_DRAFTS, resolve_model  # noqa: E402


@dataclass
class Tally:
    """Adds up StepRecords of speculating steps (an EngineObserver, verify_service)."""

    steps: int = 0
    committed: int = 0
    depth_hist: list[int] = field(default_factory=list)

    def step_finished(self, record) -> None:
        for depth, committed in zip(record.depth, record.committed):
            self.steps += 1
            self.committed += committed
            while len(self.depth_hist) <= depth:
                self.depth_hist.append(0)
            self.depth_hist[depth] += 1

    def __getattr__(self, name: str):          # the other observer hooks: no-ops
        if name in ("submitted", "prefilled", "step_started", "finished", "close"):
            return lambda *a, **k: None
        if name == "draft_context":
            return lambda: {}
        raise AttributeError(name)

    def row(self, depth: int) -> dict:
        reach = [sum(self.depth_hist[d:]) / max(1, self.steps) for d in range(1, depth + 1)]
        return {"tokens_per_step": self.committed / max(1, self.steps),
                "accept_by_depth": reach,
                "forwards_saved": 1 - self.steps / max(1, self.committed)}


def held_out_prompts(target: Path, tokenizer, files: int, prompt_tokens: int) -> list[list[int]]:
    info = json.loads((target / "TRAINING.json").read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name in info["held_out_files"][:files]:
        text = (root / name).read_text(errors="replace")[:prompt_tokens * 16]
        ids = tokenizer.encode(text)
        prompts.append(ids[:prompt_tokens])
    return prompts


async def _decode(engine, prompts: list[list[int]], max_tokens: int, plain: bool,
                  sampling: dict) -> list[list[int]]:
    from verify_service.request import GenRequest

    async def one(i: int, p: list[int]) -> list[int]:
        seq = engine.submit(GenRequest(tuple(p), max_tokens, ignore_eos=True, no_speculation=plain,
                                       sampling={**sampling, "seed": i}))
        out: list[int] = []
        while True:
            o = await seq.out.get()
            out += o.token_ids
            if o.finish_reason:
                return out
    return [await one(i, p) for i, p in enumerate(prompts)]


async def _config(target: str, method: str, draft: str | None, envelope: str,
                  prompts: list[list[int]], max_tokens: int, device: str,
                  sampling: dict, draft_sampling: str, acceptance: str) -> dict:
    from common.tree import envelope_from
    from draft_service import server as draft_server
    from draft_service.config import DraftConfig
    from verify_service.config import VerifyConfig
    from verify_service.server import build_engine

    env = envelope_from(envelope)
    dserver, dport, _ = await draft_server.start(DraftConfig(
        method=method, envelope=env, model=draft, device=device,
        draft_sampling=draft_sampling,
        target_embeddings=target if method == "dflash" else None))
    engine, _ = build_engine(VerifyConfig(model=target, draft=f"127.0.0.1:{dport}",
                                          device=device, step_deadline_ms=10_000,
                                          acceptance=acceptance))
    tally = Tally()
    engine.observer = tally
    engine.link.start()
    engine.start()
    try:
        for _ in range(500):
            if engine.link.ready:
                break
            await asyncio.sleep(0.02)
        plain = await _decode(engine, prompts, max_tokens, True, sampling)
        tally.steps = tally.committed = 0
        tally.depth_hist = []
        spec = await _decode(engine, prompts, max_tokens, False, sampling)
    finally:
        await engine.stop()
        await engine.link.close()
        await dserver.stop(0.5)
    must = not sampling.get("temperature") or acceptance == "coupled"
    return dict(tally.row(env.depth), identical=plain == spec, must_be_identical=must)


def run(target: str, envelopes: list[str], methods: list[str], files: int, prompt_tokens: int,
        max_tokens: int, device: str, sampling: dict | None = None,
        draft_sampling: str = "sample", acceptance: str = "coupled") -> list[dict]:
    """One row per method x envelope; sampling: the requests' SamplingParams fields
    (none: greedy); draft_sampling, acceptance: the services' flags."""
    from common.tokenizer import load_tokenizer
    path = resolve_model(target)
    tok = load_tokenizer(path)
    if tok is None:
        raise ValueError(f"{target} has no tokenizer; bench-accept needs one")
    prompts = held_out_prompts(path, tok, files, prompt_tokens)
    rows = []
    for method in methods:
        for env in envelopes:
            draft = str(resolve_model(SHIPPED_DRAFTS[method])) if SHIPPED_DRAFTS[method] else None
            r = asyncio.run(_config(str(path), method, draft, env, prompts, max_tokens, device,
                                    sampling or {}, draft_sampling, acceptance))
            rows.append(dict(proposer=method, envelope=env,
                             temperature=(sampling or {}).get("temperature", 0.0),
                             draft_sampling=draft_sampling, acceptance=acceptance, **r))
            print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: dict) -> str:
    depth = " ".join(f"{x:.2f}" for x in r["accept_by_depth"])
    same = "yes" if r["identical"] else "NO" if r["must_be_identical"] else "no (allowed)"
    return (f"| {r['proposer']} | {r['envelope']} | {r['tokens_per_step']:.2f} | {depth} | "
            f"{100 * r['forwards_saved']:.0f}% | {same} |")


HEADER = ("| proposer | envelope | tokens/step | accepted path reaches depth 1..D | "
          "target forwards saved | output identical |\n| --- | --- | --- | --- | --- | --- |")


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--model", default="tiny-code", help="target (needs TRAINING.json)")
    a.add_argument("--methods", default="ngram,model,eagle3")
    a.add_argument("--envelopes", default="chain4,tree-small,tree-wide")
    a.add_argument("--files", type=int, default=20, help="held-out files used")
    a.add_argument("--prompt-tokens", type=int, default=128)
    a.add_argument("--max-tokens", type=int, default=64)
    a.add_argument("--device", default="auto")
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--top-k", type=int)
    a.add_argument("--top-p", type=float)
    a.add_argument("--min-p", type=float)
    a.add_argument("--draft-sampling", default="sample", choices=["sample", "deterministic"])
    a.add_argument("--acceptance", default="coupled", choices=["coupled", "rejection"])
    a.add_argument("--json", help="also write the rows to this file")
    args = a.parse_args()
    sampling = {k: v for k in ("temperature", "top_k", "top_p", "min_p")
                if (v := getattr(args, k)) is not None}
    print(HEADER, flush=True)
    rows = run(args.model, args.envelopes.split(","), args.methods.split(","), args.files,
               args.prompt_tokens, args.max_tokens, args.device, sampling, args.draft_sampling,
               args.acceptance)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["identical"] or not r["must_be_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
