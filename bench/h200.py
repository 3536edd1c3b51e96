"""One command, one table: treespec vs HF transformers vs the weight-read floor.

    python bench/h200.py --out bench/results/h200.json

Builds random-weight models of the Qwen3-8B shape (target) and Qwen3-0.6B shape
(draft), writes them as HF checkpoints, and measures in one run: copy bandwidth
and the floor, HF eager decode, our plain decode and verify latency by N, and
end-to-end tok/s through both services (replay instrument and draft model) at
several batch sizes, with the gRPC hop's share of a step. Every figure comes from
this run. `--target-shape tiny --device cpu` smoke-tests the whole path here.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path


import torch

import shapes
from e2e_bench import AB_VARIANTS, run_e2e
from inproc_bench import (copy_bandwidth, hf_decode_tok_s, ours_from_hf,
                                verify_latency_ms)


AB_FLAGS = {"grpc": "grpc"}   # AB_VARIANTS key -> --ab-* flag


def corrupt_for(tokens_per_step: float, depth: int) -> float:
    """Per-token corruption rate whose expected tokens/step on a chain is the target:
    E = 1 + sum_{k=1..depth} (1-p)^k (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        e = 1 + sum((1 - p) ** k for k in range(1, depth + 1))
        lo, hi = (p, hi) if e > tokens_per_step else (lo, p)
    return (lo + hi) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description="treespec H200 benchmark")
    ap.add_argument("--out", required=True)
    ap.add_argument("--target-shape", default="qwen3-8b")
    ap.add_argument("--draft-shape", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--nodes", default="0,4,16,32,64")
    ap.add_argument("--sections", default="floor,hf,verify,e2e")
    ap.add_argument("--verify-iters", type=int, default=30,
                    help="timed verify steps at each (batch, nodes) of the verify section "
                         "(tests/test_bench_smoke.py's tiny CPU run takes 3)")
    ap.add_argument("--kernels", default="invariant", choices=["auto", "invariant"],
                    help="the verify section's and the e2e services' kernels: invariant = one "
                         "reduction order for every batch shape (issue 53; verify "
                         "--batch-invariant on, its default), auto = the fastest (off)")
    ap.add_argument("--verify-batches", default="1,8", help="the verify section's batches")
    ap.add_argument("--lookahead-hit-rates", default="",
                    help="e2e: also the replay with lookahead at these set hit rates "
                         "(an instrument: bench/replay.py --hit-rate), e.g. 1,0.5")
    ap.add_argument("--emulated-draft-ms", default="",
                    help="e2e: also the replays with the EMULATED REMOTE DRAFT (A[,B]: each "
                         "draft answer and lookahead takes A + B x rows ms, no compute)")
    ap.add_argument("--work", default="")
    ap.add_argument("--plant", action="store_true",
                    help="plant a successor map in the target (wide greedy margins: its "
                         "answers survive any reduction order, e.g. with --kernels auto); "
                         "default plain random weights, near-tied logits")
    for key, flag in AB_FLAGS.items():
        ap.add_argument(f"--ab-{flag}", dest=f"ab_{key}", action="store_true",
                        help=f"also, at the first batch size: {AB_VARIANTS[key][0]}")
    ap.add_argument("--replay", default="exact", choices=["exact", "random"],
                    help="4 tokens per step from the replay instrument: exactly (3 correct "
                         "drafted tokens of 4 every step) or on average (random corruption)")
    ap.add_argument("--placement", default="same", choices=["same", "split"],
                    help="split: draft on cuda:0, verify on cuda:1 (two GPUs)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    batches = [int(x) for x in a.batches.split(",")]
    sections = set(a.sections.split(","))
    work = Path(a.work or tempfile.mkdtemp(prefix="treespec-bench-"))
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "target": a.target_shape,
                 "planted_successor_map": a.plant,
                 "draft": a.draft_shape, "ctx": a.ctx,
                 "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "errors": {}}

    def save() -> None:
        Path(a.out).write_text(json.dumps(out, indent=1))

    def section(name: str, fn) -> None:
        if name not in sections:
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:
            out["errors"][name] = traceback.format_exc()
            print(out["errors"][name], flush=True)
        out.setdefault("section_s", {})[name] = time.perf_counter() - t0
        save()

    params = shapes.num_params(a.target_shape)
    out["target_params"] = params

    def floor() -> None:
        bw = copy_bandwidth(dev)
        out["copy_tb_s"] = bw / 1e12
        out["floor_ms"] = 1000 * params * 2 / bw
        out["floor_tok_s"] = bw / (params * 2)
        print(f"copy {bw / 1e12:.2f} TB/s, floor {out['floor_ms']:.2f} ms/step", flush=True)

    section("floor", floor)
    hf = shapes.random_hf_model(a.target_shape, a.device, plant=a.plant)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 151936, (1, a.ctx), generator=g).to(dev)

    def hf_sec() -> None:
        out["hf_tok_s"] = hf_decode_tok_s(hf, prompt)
        print(f"HF eager: {out['hf_tok_s']:.1f} tok/s", flush=True)

    section("hf", hf_sec)
    target_dir, draft_dir = work / f"target-{a.target_shape}", work / f"draft-{a.draft_shape}"
    if "e2e" in sections:
        out["save_s"] = shapes.save_checkpoint(hf, target_dir)
        d = shapes.random_hf_model(a.draft_shape, a.device, seed=2)
        shapes.save_checkpoint(d, draft_dir)
        del d

    def verify_sec() -> None:
        ours = ours_from_hf(hf, dev)
        lat = verify_latency_ms(ours, a.ctx, [int(x) for x in a.verify_batches.split(",")],
                                [int(x) for x in a.nodes.split(",")], kernels=a.kernels)
        out["verify_kernels"] = a.kernels
        out["verify_ms"] = lat
        out["plain_ms"] = lat["1"]["0"]
        out["plain_tok_s"] = 1000 / lat["1"]["0"]
        del ours

    hf_state_needed = "verify" in sections
    if hf_state_needed:
        section("verify", verify_sec)
    del hf
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    def e2e() -> None:
        gp = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, 151936, (a.ctx,), generator=gp).tolist()
                   for _ in range(sum(batches))]
        drafting = ("--accept", "3") if a.replay == "exact" else \
            ("--corrupt", str(corrupt_for(4.0, 4)))
        out["replay_drafting"] = " ".join(drafting)
        r = run_e2e(str(target_dir), str(draft_dir), a.device, prompts, a.max_tokens,
                    batches, drafting, work, a.placement,
                    [k for k in AB_FLAGS if getattr(a, f"ab_{k}")],
                    verify_flags=("--batch-invariant",
                                  "on" if a.kernels == "invariant" else "off"),
                    hit_rates=[float(h) for h in a.lookahead_hit_rates.split(",") if h],
                    emulated_draft_ms=a.emulated_draft_ms)
        out["emulated_draft_ms"] = a.emulated_draft_ms or None
        out["e2e"] = r
        out["e2e_kernels"] = a.kernels
        b0 = batches[0]             # the oracle4 / hop figures: at the first batch size
        first, plain0 = r[f"replay_b{b0}"], r.get(f"plain_b{b0}", {})
        out["oracle4_tok_s"] = first["tok_s"]
        out["oracle4_tokens_per_step"] = first["tokens_per_step"]
        if "decode_tok_s" in first and "decode_tok_s" in plain0:
            # oracle4_tok_s / plain counts each request's prefill too; this is decode only
            out["oracle4_decode_ratio"] = first["decode_tok_s"] / plain0["decode_tok_s"]
        # the hop as a serving step pays it (the verify service's own histogram)
        if "hop_ms" in first and "step_ms" in first:
            out["hop_share"] = first["hop_ms"] / first["step_ms"]
        for key in AB_FLAGS:                              # replay variants
            if f"replay_b{b0}_{key}" in r:
                n = r[f"replay_b{b0}_{key}"]
                out[f"oracle4_tok_s_{key}"] = n["tok_s"]
                out[f"hop_share_{key}"] = n["hop_ms"] / n["step_ms"] if "hop_ms" in n else None
        out["batch_tok_s"] = {str(b): {"plain": r[f"plain_b{b}"]["tok_s"],
                                       "spec": r[f"replay_b{b}"]["tok_s"],
                                       **{k[:-len(f"_b{b}")]: v["tok_s"] for k, v in r.items()
                                          if k.startswith(("replay_la", "replay_em"))
                                          and k.endswith(f"_b{b}")}}
                              for b in batches}

    section("e2e", e2e)
    print(json.dumps({k: v for k, v in out.items() if k not in ("e2e", "errors")}, indent=1))
    if out["errors"]:
        print("sections with errors:", list(out["errors"]))


if __name__ == "__main__":
    main()
