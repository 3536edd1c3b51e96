"""What drawing costs in the verify step, on the GPU: the captured step's replay for
greedy rows, sampled rows under coupled acceptance and sampled rows under rejection
sampling (q of 32 ids per node), chain4 trees, batch 1 and 32, 1024-token contexts.

    python bench/sampled_step.py --out DIR/sampled_step.json [--shape qwen3-8b]

Sampling is T 0.6, top-k 20, top-p 0.95 (Qwen3's generation_config.json). Random
weights, in process (no services); the issue's goal is a sampled step <= 1.1 x a
greedy one. `--shape tiny --device cpu` smoke-runs it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


import torch

from inproc_bench import replay_ms
from profile_step import random_model
from treespec.common.runtime.kv_cache import SeqPages
from treespec.common.spec.sampling import DRAFT_Q, SamplingParams
from treespec.common.spec.tree import TreeBatch
from treespec.kernels.dispatch import select
from treespec.common.spec.sampling_batch import SamplingBatch
from treespec.verify_service.verifier import Verifier, VerifyBatch


def trees(b: int, vocab: int, q: bool, g: torch.Generator) -> TreeBatch:
    t = TreeBatch(torch.randint(0, vocab, (b, 4), generator=g, dtype=torch.int32),
                  torch.arange(-1, 3, dtype=torch.int32).expand(b, 4).contiguous())
    if q:
        t.q_ids = torch.randint(0, vocab, (b, 4, DRAFT_Q), generator=g, dtype=torch.int32)
        t.q_ids[..., 0] = t.tokens
        p = torch.rand(b, 4, DRAFT_Q, generator=g)
        t.q_probs = p / p.sum(-1, keepdim=True)
    return t


def wall_ms(step, pages: list[SeqPages], ctx: int) -> float:
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        step()
        times.append(1000 * (time.perf_counter() - t0))
        for sp in pages:
            sp.kv_len = ctx
    return sorted(times)[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (wall ms, no graphs)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    model = random_model(a.shape, dev)
    vocab = model.spec.vocab_size
    batches = [int(x) for x in a.batches.split(",")]
    cache = model.new_cache(max(batches) * (-(-(a.ctx + 80) // 16)) + 64, 16)
    ver = Verifier(model, cache, select(dev, "triton" if dev.type == "cuda" else "reference"))
    g = torch.Generator().manual_seed(0)
    res: dict = {"shape": a.shape, "ctx": a.ctx, "rows": {}}
    for b in batches:
        pages = [SeqPages() for _ in range(b)]
        prompts = [torch.randint(0, vocab, (a.ctx,), generator=g).tolist() for _ in range(b)]
        roots = []
        for i in range(0, b, 8):
            roots += ver.prefill(pages[i:i + 8], prompts[i:i + 8])[0]
        params = [SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=s + 1)
                  for s in range(b)]
        row = {}
        for mode, ps, q in (("greedy", None, False), ("coupled", params, False),
                            ("rejection", params, True)):
            t = trees(b, vocab, q, g)
            batch = VerifyBatch(pages, roots, t, 4, SamplingBatch(ps) if ps else None)
            for _ in range(3):                      # capture, then warm
                ver.step(batch)
                for sp in pages:
                    sp.kv_len = a.ctx
            key = (ver._family(batch), *ver.buckets.buckets(pages))
            graph = ver.buckets.graphs[key].graph
            row[mode] = replay_ms(graph) if graph is not None else wall_ms(
                lambda: ver.step(batch), pages, a.ctx)
        row["coupled_over_greedy"] = row["coupled"] / row["greedy"]
        row["rejection_over_greedy"] = row["rejection"] / row["greedy"]
        res["rows"][str(b)] = row
        print(f"b={b}: {json.dumps(row)}", flush=True)
        for sp in pages:
            cache.release(sp)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
