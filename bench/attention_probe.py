"""Tree attention alone at the Qwen3-8B head shape (or the 0.6B draft model's), on the
GPU: per-layer µs by tree size, for the parents walk against precomputed ancestor words,
and for a few tilings, for one sequence or a batch of them.

    python bench/attention_probe.py --out FILE [--ctx 1024] [--nodes 0,4,16,64]
        [--batch 32] [--shape 0.6b]
    python bench/attention_probe.py --invariant --out FILE [...]   # runs
        bench/attention_invariance_gpu.py with the other arguments instead (so that
        bench/device_session.sh's attention step can run it: ATTN_ARGS=--invariant)

Each figure is one call's device time inside a CUDA graph of 36 calls (one per layer
of the model), so launch gaps count as they do in a verify step. Random q/k/v, one
sequence, random trees no deeper than 8 (bench/inproc_bench.random_trees); the page
table is as wide as the verify step's page bucket (the next power of two of the
pages in use, the rest pointing at a scratch page), as in a captured step. This is for
choosing the kernel's plan; bench/h200.py's verify_ms is the figure that counts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path


import torch

from inproc_bench import cuda_ms, random_trees
from treespec.common.spec.tree import verify_chunk_layout
from treespec.kernels.triton_ancestors import tree_ancestors
from treespec.kernels.triton_tree_attention import _plan, paged_tree_attention

BS = 16
SHAPES = {"8b": (36, 32, 8, 128), "0.6b": (28, 16, 8, 128)}     # layers, q / kv heads, D


def main() -> None:
    if "--invariant" in sys.argv:
        import attention_invariance_gpu
        sys.argv.remove("--invariant")
        return attention_invariance_gpu.main()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--nodes", default="0,4,16,64")
    ap.add_argument("--batch", type=int, default=1, help="sequences, each of --ctx tokens")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    a = ap.parse_args()
    layers, hq, hkv, d = SHAPES[a.shape]
    b = a.batch
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    live = -(-(a.ctx + 80) // BS)
    width = max(256, 1 << (live - 1).bit_length())           # the page bucket
    kc = torch.randn(b * live + 1, BS, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.full((b, width), b * live, dtype=torch.int32)  # the last page: scratch
    table[:, :live] = torch.randperm(b * live, generator=g).to(torch.int32).view(b, live)
    table = table.to(dev)
    ctx = torch.full((b,), a.ctx, device=dev, dtype=torch.int32)
    res: dict = {"ctx": a.ctx, "batch": b, "shape": a.shape, "table_width": width,
                 "sms": torch.cuda.get_device_properties(dev).multi_processor_count}
    for n in (int(x) for x in a.nodes.split(",")):
        t = n + 1
        node_par = random_trees(1, n, min(n, 8), g) if n else torch.zeros(1, 0, dtype=torch.int32)
        chunk_par, _ = verify_chunk_layout(node_par.expand(b, -1))
        chunk_par = chunk_par.to(dev, torch.int32)
        cu = torch.arange(b + 1, device=dev, dtype=torch.int32) * t
        q = torch.randn(b * t, hq, d, device=dev, dtype=torch.bfloat16)
        flat = chunk_par.reshape(-1)
        anc = tree_ancestors(chunk_par)
        default = _plan(b * t, b, hq // hkv, hkv, table.shape[1] * BS, dev, None, None, None,
                        tree=n > 0)
        row = {"default_plan": default[:3]}
        for use_anc, block_m, splits in itertools.product(
                (False, True), (None, 64, 128), (None, 1, 2, 3, 5, 9, 17)):
            if use_anc and n == 0:
                continue
            kw = {"block_m": block_m, "num_splits": splits}

            def call() -> None:
                paged_tree_attention(q, kc, vc, table, ctx, cu, flat, d ** -0.5,
                                     anc if use_anc else None, **kw)
            key = f"{'anc' if use_anc else 'walk'}_m{block_m or 'auto'}_s{splits or 'auto'}"
            row[key] = 1000 * cuda_ms(call, layers)
        best = min((k for k in row if k.startswith(("walk_", "anc_"))), key=row.get)
        row["ancestors_us"] = 1000 * cuda_ms(lambda: tree_ancestors(chunk_par), 10)
        row["best"] = best
        res[str(n)] = row
        print(n, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
