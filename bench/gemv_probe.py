"""Skinny linears on the GPU: cuBLAS (F.linear, + silu_mul for gate_up) against
kernels/triton_gemv.py over a sweep of tile configs, at the Qwen3-8B projections
(--shapes 8b), the Qwen3-0.6B draft model's (0.6b) or the 8B EAGLE-3 head's (eagle3).

    python bench/gemv_probe.py --out DIR [--rows 1,5,16] [--shapes 8b,0.6b,eagle3]

Each timing replays a CUDA graph that walks several copies of the weight (more
bytes than L2 holds, as a real step's 36 layers do), median of 5 replays.
Writes DIR/gemv_probe.json: per projection and row count, cuBLAS ms and TB/s,
every Triton config's ms, the best config, and the correctness checks (error
against an fp32 product; a row's output equal whatever the row count).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
from pathlib import Path


import torch
import torch.nn.functional as F

from inproc_bench import replay_ms
from treespec.kernels import triton_gemv
from treespec.kernels.triton_fused import silu_mul

# name: (N output columns, K, fused SwiGLU)
SHAPES = {"8b": {"qkv": (6144, 4096, False), "o_proj": (4096, 4096, False),
                 "gate_up": (24576, 4096, True), "down": (4096, 12288, False),
                 "lm_head": (151936, 4096, False)},
          "0.6b": {"qkv": (4096, 1024, False), "o_proj": (1024, 2048, False),
                   "gate_up": (6144, 1024, True), "down": (1024, 3072, False),
                   "lm_head": (151936, 1024, False)},
          "eagle3": {"qkv": (6144, 8192, False), "fc": (4096, 12288, False),
                     "lm_head": (32000, 4096, False)}}
SWEEP = list(itertools.product((16, 32, 64), (256, 512), (4, 8), (2, 4))) + [
    (8, 512, 4, 3), (16, 1024, 4, 3), (16, 1024, 8, 2), (32, 128, 4, 4)]
# past 16 rows the x tile grows with the row class: smaller K tiles
SWEEP_WIDE = list(itertools.product((32, 64), (64, 128), (4, 8), (3,))) + [
    (64, 64, 4, 4), (32, 128, 4, 2), (128, 64, 8, 3)]


def graph_ms(fns: list, reps: int = 4) -> float:
    """Median device ms of one fn, from a graph of reps passes over fns."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in fns:
                f()
    return replay_ms(g, reps=5) / (reps * len(fns))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,5,16")
    ap.add_argument("--name", default="gemv_probe", help="output file stem")
    ap.add_argument("--shapes", default="8b", help=f"of {', '.join(SHAPES)}")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    res: dict = {}
    shapes = {f"{group}:{name}": v for group in a.shapes.split(",")
              for name, v in SHAPES[group].items()}
    for name, (n, k, silu) in shapes.items():
        nbytes = n * k * 2
        copies = max(2, -(-600_000_000 // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        entry: dict = {"N": n, "K": k, "silu": silu, "copies": copies}
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            if silu:
                def ref_fn(w, x=x):
                    return silu_mul(F.linear(x, w))

                def ours(w, cfg, x=x):
                    return triton_gemv.linear_silu_mul(x, w, cfg)
            else:
                def ref_fn(w, x=x):
                    return F.linear(x, w)

                def ours(w, cfg, x=x):
                    return triton_gemv.linear(x, w, cfg)
            row: dict = {}
            ms = graph_ms([lambda w=w: ref_fn(w) for w in ws])
            row["cublas_ms"] = ms
            row["cublas_tb_s"] = nbytes / ms / 1e9
            exact = ref_fn(ws[0]).float()
            tri: dict = {}
            for cfg in (SWEEP if m <= 16 else SWEEP_WIDE):
                try:
                    got = ours(ws[0], cfg).float()
                    err = ((got - exact).norm() / exact.norm()).item()
                    if not err < 2e-2:
                        tri[str(cfg)] = {"error": err}
                        continue
                    tri[str(cfg)] = {"ms": graph_ms([lambda w=w, c=cfg: ours(w, c) for w in ws]),
                                     "rel_err": err}
                except Exception as e:      # a config that does not compile or fit
                    tri[str(cfg)] = {"error": repr(e)[:200]}
            timed = {c: v for c, v in tri.items() if "ms" in v}
            best = min(timed, key=lambda c: timed[c]["ms"])
            row["triton"] = tri
            row["best"] = best
            row["best_ms"] = timed[best]["ms"]
            row["best_tb_s"] = nbytes / timed[best]["ms"] / 1e9
            row["speedup"] = ms / timed[best]["ms"]
            if 1 < m <= 16:     # row invariance: row 0 alone equals row 0 among m
                cfg = ast.literal_eval(best)
                one = ours(ws[0], cfg, x=x[:1])
                many = ours(ws[0], cfg)
                row["row_invariant"] = bool(torch.equal(one[0], many[0]))
            entry[str(m)] = row
            print(f"{name:14s} M={m:2d} cublas {ms * 1000:7.1f} us {row['cublas_tb_s']:.2f} TB/s"
                  f" | triton best {best} {row['best_ms'] * 1000:7.1f} us"
                  f" {row['best_tb_s']:.2f} TB/s x{row['speedup']:.2f}", flush=True)
        res[name] = entry
        del ws
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
