"""How well each proposer x envelope speculates on held-out text.

    python bench/bench_accept.py [--model tiny-code] [--methods ngram,model,eagle3]
        [--envelopes chain4,tree-small,15x4x16] [--files 8] [--prompt-tokens 128]
        [--max-tokens 48] [--temperature T [--top-k K --top-p P --min-p M]]
        [--draft-sampling sample|deterministic] [--acceptance coupled|rejection]
        [--device auto] [--json FILE]

For every configuration it starts both services as `treespec` child processes on
loopback (the verify with `--speculation always`, so every step speculates and the
figures are the proposer's, not the controller's), decodes a window of each held-out
file (the target's TRAINING.json names them; they come from this Python's standard
library) plain and then speculatively, one prompt at a time, and reports tokens per
step (bonus included), the fraction of drafts whose accepted path reached each depth
(from the verify's /metrics), the target forwards saved, and whether the output
equals plain decode's. At a temperature above 0 prompt i is seeded i: the output must
be identical greedy and under coupled acceptance; under rejection sampling it depends
on the drafter (its distribution does not), so it is reported, not required.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path


from treespec.common.cli import ConfigError, positive_int
from treespec.common.client import TreespecClient
from treespec.common.serving.launch import start_service
from treespec.common.model.paths import SHIPPED_DRAFTS, resolve_model

HEADER = ("| proposer | envelope | tokens/step | accepted path reaches depth 1..D | "
          "target forwards saved | output identical |\n| --- | --- | --- | --- | --- | --- |")
POSITION = re.compile(r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{.*position="(\d+)"'
                      r'.*\} (\S+)$')
DRAFTS = re.compile(r"^vllm:spec_decode_num_drafts_total\{.*\} (\S+)$")


def held_out_prompts(target: Path, files: int, prompt_tokens: int) -> list[list[int]]:
    """The first prompt_tokens tokens of the target's first `files` held-out files."""
    from treespec.common.model.tokenizer import load_tokenizer
    tok = load_tokenizer(target)
    info_path = target / "TRAINING.json"
    if tok is None or not info_path.exists():
        raise ValueError(f"{target} needs a tokenizer and a TRAINING.json naming held-out files")
    root = Path(sysconfig.get_paths()["stdlib"])
    names = json.loads(info_path.read_text())["held_out_files"][:files]
    return file_start_prompts(tok, [(root / n).read_text(errors="replace") for n in names],
                              prompt_tokens)


def file_start_prompts(tok, texts: list[str], prompt_tokens: int) -> list[list[int]]:
    """The first prompt_tokens tokens of each text (bench-accept's prompts; a text's
    first 16 characters a token are plenty)."""
    return [tok.encode(t[:prompt_tokens * 16])[:prompt_tokens] for t in texts]


def accepted_by_position(url: str) -> tuple[float, dict[int, float]]:
    """(drafts, accepted tokens by position) so far, from the verify's /metrics."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    drafts, pos = 0.0, {}
    for line in text.splitlines():
        if m := DRAFTS.match(line):
            drafts += float(m.group(1))
        elif m := POSITION.match(line):
            pos[int(m.group(1))] = pos.get(int(m.group(1)), 0.0) + float(m.group(2))
    return drafts, pos


def envelope_args(envelope: str) -> list[str]:
    """The draft's flags for an envelope: a preset's name, or DEPTHxTOPKxNODES."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", envelope)
    return ["--envelope", envelope] if m is None else [
        "--depth", m[1], "--topk", m[2], "--nodes", m[3]]


def measure(target: str, method: str, envelope: str, prompts: list[list[int]], max_tokens: int,
            device: str, sampling: dict, draft_sampling: str, acceptance: str,
            draft: str | None = None, timeout: float = 180.0) -> dict:
    """One row: both services for this configuration, plain then speculative decode
    (draft: the method's checkpoint, by default the shipped one)."""
    draft_args = ["draft", "--method", method, *envelope_args(envelope), "--port", "0",
                  "--device", device, "--draft-sampling", draft_sampling]
    if method != "ngram" and (draft or SHIPPED_DRAFTS.get(method)):
        draft_args += ["--model", draft or SHIPPED_DRAFTS[method]]
    if method in ("eagle3", "dflash"):
        draft_args += ["--target-embeddings", target]
    with start_service("draft", draft_args, timeout) as dsvc, start_service("verify", [
            "verify", "--model", target, "--draft", dsvc.addr, "--port", "0", "--device",
            device, "--speculation", "always", "--acceptance", acceptance,
            "--metrics-port", "0", "--step-deadline-ms", "10000"], timeout) as verify:
        url = re.search(r"metrics on (http://\S+/metrics)", verify.output()).group(1)
        with TreespecClient(verify.addr, timeout=600) as c:
            c.wait_ready(timeout)
            end = time.monotonic() + timeout
            while not c.info().draft_connected:
                if time.monotonic() > end:
                    raise TimeoutError(f"the verify never connected to draft {dsvc.addr}")
                time.sleep(0.1)
            outs = {}
            for plain in (True, False):
                outs[plain] = [c.generate(prompt_ids=p, max_tokens=max_tokens, ignore_eos=True,
                                          no_speculation=plain, **sampling, seed=i)
                               for i, p in enumerate(prompts)]
        drafts, pos = accepted_by_position(url)
    stats = [o.stats for o in outs[False]]
    steps = sum(s["steps"] for s in stats)
    made = sum(s["completion_tokens"] - 1 for s in stats)   # the prefill's token is no step's
    depth = max(pos, default=-1) + 1
    return {"tokens_per_step": made / max(1, steps),
            "accept_by_depth": [pos.get(d, 0.0) / max(1.0, drafts) for d in range(depth)],
            "forwards_saved": 1 - steps / max(1, made),
            "identical": [o.token_ids for o in outs[False]] == [o.token_ids for o in outs[True]],
            "must_be_identical": not sampling.get("temperature") or acceptance == "coupled"}


def format_row(r: dict) -> str:
    depth = " ".join(f"{x:.2f}" for x in r["accept_by_depth"])
    same = "yes" if r["identical"] else "NO" if r["must_be_identical"] else "no (allowed)"
    return (f"| {r['proposer']} | {r['envelope']} | {r['tokens_per_step']:.2f} | {depth} | "
            f"{100 * r['forwards_saved']:.0f}% | {same} |")


def add_arguments(a: argparse.ArgumentParser) -> None:
    a.add_argument("--model", default="tiny-code", help="target (its TRAINING.json names the "
                   "held-out files)")
    a.add_argument("--methods", default="ngram,model,eagle3")
    a.add_argument("--draft", help="the draft checkpoint of a single method (default: the "
                   "shipped one of each method, drafts for tiny-code)")
    a.add_argument("--envelopes", default="chain4,tree-small",
                   help="presets, or DEPTHxTOPKxNODES for a custom envelope (15x4x16: 15 "
                        "deep, each node's 4 best children, the best 16 nodes)")
    a.add_argument("--files", type=positive_int, default=8, help="held-out files used")
    a.add_argument("--prompt-tokens", type=positive_int, default=128)
    a.add_argument("--max-tokens", type=positive_int, default=48)
    a.add_argument("--device", default="auto")
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--top-k", type=int)
    a.add_argument("--top-p", type=float)
    a.add_argument("--min-p", type=float)
    a.add_argument("--draft-sampling", default="sample", choices=["sample", "deterministic"])
    a.add_argument("--acceptance", default="coupled", choices=["coupled", "rejection"])
    a.add_argument("--json", help="also write the rows to this file")


def run(args: argparse.Namespace) -> int:
    """Prints a Markdown table; exit 1 when a row that must be identical is not."""
    if args.draft and "," in args.methods:
        raise ConfigError("--draft names one method's checkpoint: give one --methods")
    target = resolve_model(args.model)
    prompts = held_out_prompts(target, args.files, args.prompt_tokens)
    sampling = {k: v for k in ("temperature", "top_k", "top_p", "min_p")
                if (v := getattr(args, k)) is not None}
    print(HEADER, flush=True)
    rows = []
    for method in args.methods.split(","):
        for env in args.envelopes.split(","):
            r = measure(str(target), method, env, prompts, args.max_tokens, args.device,
                        sampling, args.draft_sampling, args.acceptance, args.draft)
            rows.append(dict(proposer=method, envelope=env, temperature=args.temperature,
                             draft_sampling=args.draft_sampling, acceptance=args.acceptance,
                             **r))
            print(format_row(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["identical"] or not r["must_be_identical"] for r in rows) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        sys.exit(run(parser.parse_args()))
    except ConfigError as e:
        parser.error(str(e))
