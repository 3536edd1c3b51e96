"""Where a plain decode step's time goes, on the GPU: wall step vs graph replay, for
four variants of the same step (cuBLAS linears; the Triton GEMVs; the Triton GEMVs
with programmatic dependent launch; the same capturing the EAGLE-3 head's target
layers, as beside a drafter of hidden states), the kernels inside it, and each
projection's cuBLAS GEMV against the copy bandwidth.

    python bench/profile_step.py --out DIR [--shape qwen3-8b] [--ctx 1024] [--batch 1]

Writes DIR/profile.json (timings) and DIR/kernels.txt (torch.profiler tables of
graph-replayed steps, by CUDA time: the plain step, then verify steps of --nodes random
trees, so a tree step's extra cost can be read kernel by kernel). Random weights; nothing here is a result for users, it
explains the gap between bench/h200.py's plain step and its floor.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace


import torch

import shapes
from inproc_bench import copy_bandwidth, cuda_ms, random_trees, replay_ms
from treespec.common.runtime.devices import pick_device
from treespec.common.runtime.graph_buckets import bucket
from treespec.common.runtime.kv_cache import SeqPages
from treespec.common.spec.tree import TreeBatch
from treespec.common.model.config import Qwen3Spec
from treespec.common.model.qwen3 import Qwen3Model
from treespec.kernels import reference
from treespec.kernels.dispatch import KERNEL_NAMES, select
from treespec.kernels.triton_common import set_pdl
from treespec.verify_service.verifier import Verifier, VerifyBatch


def random_model(name: str, dev: torch.device, plant: bool = False) -> Qwen3Model:
    spec = Qwen3Spec.from_dict(shapes.config(name).to_dict())
    with torch.device(dev):
        model = Qwen3Model(spec).to(torch.bfloat16)
    model.inv_freq = model.inv_freq.float()     # .to() cast the RoPE buffer too
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    if plant:
        shapes.plant_successor(model.embed.weight, model.lm_head.weight, 0)
    return model.eval().requires_grad_(False)


def gemv_table(model: Qwen3Model, bw: float) -> dict:
    """Each projection of one layer (and the LM head) at batch 1: ms and share of bw."""
    layer = model.layers[0]
    out = {}
    for name, lin in [("qkv", layer.qkv), ("o_proj", layer.o_proj),
                      ("gate_up", layer.gate_up), ("down", layer.down),
                      ("lm_head", model.lm_head)]:
        x = torch.randn(1, lin.in_features, device=model.device, dtype=model.dtype)
        ms = cuda_ms(lambda: lin(x))
        nbytes = lin.weight.numel() * 2
        rate = nbytes / (ms / 1000)
        out[name] = {"ms": ms, "tb_s": rate / 1e12, "of_copy_bw": rate / bw}
    return out


def tree_profile(ver: Verifier, pages: list[SeqPages], roots: list[int], ctx: int,
                 nodes: list[int], out_dir: Path | None, steps: int = 5) -> dict:
    """Per tree size: replay ms, and each kernel's CUDA ms per step (profiler), so the
    cost a tree adds over a plain step shows kernel by kernel. Tables -> kernels.txt."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator().manual_seed(0)
    vocab = ver.model.spec.vocab_size
    out, text = {}, []
    for n in nodes:
        depth = min(n, 8)
        tok = torch.randint(0, vocab, (1, n), generator=g, dtype=torch.int32) if n else None
        par = random_trees(1, n, depth, g) if n else None
        for _ in range(3):                      # capture and warm
            ver.step(VerifyBatch(pages, roots, TreeBatch(tok, par) if n else None, depth))
            pages[0].kv_len = ctx
        graph = [v for k, v in ver.buckets.graphs.items() if k[0][0] == n][0]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                ver.step(VerifyBatch(pages, roots, TreeBatch(tok, par) if n else None, depth))
                pages[0].kv_len = ctx
            torch.cuda.synchronize()
        per_kernel = {e.key[:90]: round(e.device_time_total / 1000 / steps, 4)
                      for e in prof.key_averages() if e.device_time_total > 0}
        out[str(n)] = {"replay_ms": replay_ms(graph.graph),
                       "kernel_ms": dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]))}
        text.append(f"{steps} graph-replayed verify steps, {n} nodes\n" + prof.key_averages()
                    .table(sort_by="cuda_time_total", row_limit=25))
        print(f"tree {n}: replay {out[str(n)]['replay_ms']:.3f} ms", flush=True)
    if out_dir is not None:
        (out_dir / "kernels.txt").write_text("\n\n".join(text))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--nodes", default="0,4,16,64", help="tree sizes to profile (GEMV+PDL)")
    ap.add_argument("--batch", type=int, default=1, help="sequences a variant's step runs "
                    "(the per-kernel tree tables: batch 1 only)")
    a = ap.parse_args()
    dev = pick_device("cuda")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"shape": a.shape, "ctx": a.ctx, "batch": a.batch}
    bw = copy_bandwidth(dev)
    res["copy_tb_s"] = bw / 1e12
    model = random_model(a.shape, dev)
    weight_bytes = sum(p.numel() for n, p in model.named_parameters() if n != "embed.weight") * 2
    res["read_floor_ms"] = 1000 * weight_bytes / bw     # weights a step reads (no embedding)
    res["gemv"] = gemv_table(model, bw)
    L = model.spec.num_layers
    res["gemv_sum_ms"] = L * sum(res["gemv"][k]["ms"] for k in ("qkv", "o_proj", "gate_up",
                                                              "down")) + res["gemv"]["lm_head"]["ms"]
    bs = 16
    cache = model.new_cache(a.batch * -(-(a.ctx + 80) // bs) + 8, bs)
    prompt = torch.randint(0, model.spec.vocab_size, (a.ctx,)).tolist()
    triton_ops = select(dev, "triton")
    cublas_ops = SimpleNamespace(**{n: getattr(triton_ops, n) for n in KERNEL_NAMES})
    cublas_ops.linear, cublas_ops.linear_silu_mul = (
        reference.linear, lambda x, w: triton_ops.silu_mul(reference.linear(x, w)))
    variants = {"cublas": (cublas_ops, False, ()), "gemv": (triton_ops, False, ()),
                "gemv_pdl": (triton_ops, True, ()),
                "gemv_pdl_capture": (triton_ops, True,
                                     tuple(shapes.EAGLE3.get(a.shape, {}).get("aux", ())))}
    chain = torch.randint(0, model.spec.vocab_size, (1, 4), dtype=torch.int32).repeat(a.batch, 1)
    parents = torch.arange(-1, 3, dtype=torch.int32).repeat(a.batch, 1)
    res["variants"] = {}
    for label, (ops, pdl, capture) in variants.items():
        set_pdl(pdl)
        ver = Verifier(model, cache, ops)
        ver.capture_layers = capture
        pages = [SeqPages() for _ in range(a.batch)]
        roots, _ = ver.prefill(pages, [prompt] * a.batch)
        row = {}
        for n, (tok, par, depth) in {"0": (None, None, 0), "4": (chain, parents, 4)}.items():
            times = []
            for _ in range(30):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                ver.step(VerifyBatch(pages, roots,
                                     None if tok is None else TreeBatch(tok, par), depth))
                times.append(time.perf_counter() - t0)
                for sp in pages:                # back to the prompt: same context every step
                    sp.kv_len = a.ctx
            row[f"wall_ms_{n}"] = 1000 * sorted(times[5:])[len(times[5:]) // 2]
            # the step's own batch bucket (a first capture makes every bucket up to it)
            g = [v for k, v in ver.buckets.graphs.items()
                 if k[0][0] == (0 if tok is None else 4) and k[1] == bucket(a.batch)][0]
            row[f"replay_ms_{n}"] = replay_ms(g.graph)
        res["variants"][label] = row
        print(label, row, flush=True)
        if label != "cublas" and a.batch == 1:
            # kernel times without PDL: with it, a kernel's time includes waiting on its
            # predecessor, so only the replay total is meaningful
            row["trees"] = tree_profile(ver, pages, roots, a.ctx,
                                        [int(n) for n in a.nodes.split(",")],
                                        out_dir if label == "gemv" else None)
        for sp in pages:
            cache.release(sp)
        del ver
    set_pdl(None)
    (out_dir / "profile.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
