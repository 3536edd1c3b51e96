"""The Triton tree attention's batch-invariant mode on a GPU at the Qwen3-8B head shape
(32 q / 8 kv heads, head_dim 128, bf16, 16-slot pages): bitwise checks, then its time
against the default mode.

    python bench/attention_invariance_gpu.py --out FILE [--ctxs 1024,4096]
        [--batches 1,8,32,64] [--nodes 0,4,16,64] [--split-keys 256[,128,...]]
        [--block-m 16[,64]] [--skip-timing]

Checks (as tests/test_triton_attention_invariance.py, at this shape; the run exits 1 if
an invariant one fails): the output row of a query at position p (near each context
length) is bit for bit the same (a) alone, (b) among 5 and among 64 decode rows of other
sequences, at first, middle and last place, (c) as the last row of a 17-row prefill
chunk, (d) as a depth-3 tree node with siblings between its ancestors; and one program
per key chunk gives the bits of one program per query tile. Reported, not required:
the default mode on the same cases (the control: it should fail some), and whether
BLOCK_M 64 gives BLOCK_M 16's bits (if it does, the invariant plan may pick BLOCK_M by
batch shape).

Times: per-layer µs of one call inside a CUDA graph of 36 calls (inproc_bench.cuda_ms),
default (with the tree_ancestors words, as the verify step passes them) and invariant
at each --split-keys x --block-m (the checks use the first of each; a BLOCK_M is a
reduction order too, so the plan may take one other than the default only if the
block_m64 check says its bits are the same, or as the one constant), at each batch x
tree nodes x context;
random trees no deeper than 8; the page table as wide as a captured step's page bucket,
as bench/attention_probe.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from inproc_bench import cuda_ms, random_trees
from treespec.common.spec.tree import verify_chunk_layout
from treespec.kernels.triton_ancestors import tree_ancestors
from treespec.kernels.triton_tree_attention import paged_tree_attention
from treespec.kernels.triton_tree_attention_invariant import (INVARIANT_BLOCK_M,
                                                              INVARIANT_SPLIT_KEYS,
                                                              _plan_invariant)

HQ, HKV, D, BS, LAYERS = 32, 8, 128, 16, 36
DT = torch.bfloat16
DEV = torch.device("cuda")
TREE = [-1, 0, 0, 2, 2, 4, 4]           # [root, x, a, y, b, z, c]: c at depth 3 via a, b
PATH = [0, 2, 4, 6]


def attend(entries: list[tuple], seed: int, **kw) -> list[torch.Tensor]:
    """entries: (keys, values [ctx + t, kv_heads, D] by slot, ctx, chunk parents [t],
    q [t, q_heads, D]) in one shuffled paged cache, attended in one call; each entry's
    output rows."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-k.shape[0] // BS) for k, *_ in entries]
    pages = torch.randperm(sum(need) + 1, generator=g).tolist()
    kc = torch.randn(len(pages), BS, HKV, D, device=DEV).to(DT)
    vc = torch.randn_like(kc)
    width = 1 << (max(need) - 1).bit_length()       # a page bucket
    table = torch.full((len(entries), width), pages[-1], dtype=torch.int32)
    at = 0
    for i, (k, v, *_) in enumerate(entries):
        mine = torch.tensor(pages[at:at + need[i]])
        at += need[i]
        table[i, :need[i]] = mine
        slots = (mine.repeat_interleave(BS)[:k.shape[0]] * BS
                 + torch.arange(k.shape[0]) % BS).to(DEV)
        kc.view(-1, HKV, D)[slots] = k
        vc.view(-1, HKV, D)[slots] = v
    lens = [len(e[3]) for e in entries]
    cu = torch.tensor([0] + lens).cumsum(0).to(DEV, torch.int32)
    ctx = torch.tensor([e[2] for e in entries], dtype=torch.int32, device=DEV)
    par = torch.tensor([x for e in entries for x in e[3]], dtype=torch.int32, device=DEV)
    q = torch.cat([e[4] for e in entries])
    out = paged_tree_attention(q, kc, vc, table.to(DEV), ctx, cu, par, D ** -0.5, **kw)
    return list(out.split(lens))


def row_checks(positions: list[int], seed: int, **kw) -> dict[str, list[bool]]:
    """Per case, per position (and place), whether the row equals the row alone."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device=DEV).to(DT)
    kv = {p: (rnd(p + 1, HKV, D), rnd(p + 1, HKV, D), rnd(1, HQ, D)) for p in positions}
    decode = {p: (k, v, p, [-1], q) for p, (k, v, q) in kv.items()}
    lens = torch.randint(1, max(positions), (63,), generator=torch.Generator().manual_seed(seed))
    others = [(rnd(n + 1, HKV, D), rnd(n + 1, HKV, D), n, [-1], rnd(1, HQ, D))
              for n in lens.tolist()]
    alone = {p: attend([decode[p]], 1, **kw)[0][0] for p in positions}
    res: dict[str, list[bool]] = {"batch5": [], "batch64": [], "prefill": [], "tree": []}
    for p in positions:
        for size in (5, 64):
            for place in (0, size // 2, size - 1):
                rows = others[:size - 1]
                rows = rows[:place] + [decode[p]] + rows[place:]
                res[f"batch{size}"].append(torch.equal(attend(rows, 2, **kw)[place][0],
                                                       alone[p]))
        k, v, q = kv[p]
        c0 = p - 16
        chunk = (k, v, c0, list(range(-1, 16)), torch.cat([rnd(16, HQ, D), q]))
        res["prefill"].append(torch.equal(attend([others[0], chunk], 3, **kw)[1][-1], alone[p]))
        ctx = p - 3
        tk, tv = rnd(ctx + 7, HKV, D), rnd(ctx + 7, HKV, D)
        tk[:ctx], tv[:ctx] = k[:ctx], v[:ctx]
        tk[[ctx + j for j in PATH]], tv[[ctx + j for j in PATH]] = k[ctx:], v[ctx:]
        tq = rnd(7, HQ, D)
        tq[6] = q[0]
        out = attend([others[1], (tk, tv, ctx, TREE, tq)], 4, **kw)
        res["tree"].append(torch.equal(out[1][6], alone[p]))
    return res


def mixed_batch(positions: list[int]) -> list[tuple]:
    """Per position a 64-node random tree, a 17-row prefill chunk and a decode row."""
    g = torch.Generator().manual_seed(5)
    entries = []
    for p in positions:
        par, _ = verify_chunk_layout(random_trees(1, 64, 8, g))
        for chunk in (par[0].tolist(), list(range(-1, 16)), [-1]):
            k = torch.randn(p + len(chunk), HKV, D, generator=g).to(DEV, DT)
            entries.append((k, torch.randn_like(k), p, chunk,
                            torch.randn(len(chunk), HQ, D, generator=g).to(DEV, DT)))
    return entries


def same_bits(entries: list[tuple], a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(attend(entries, 6, **a), attend(entries, 6, **b)))


def timings(ctx: int, b: int, n: int, variants: list[tuple[int, int]]) -> dict:
    g = torch.Generator().manual_seed(0)
    live = -(-(ctx + 80) // BS)
    width = max(256, 1 << (live - 1).bit_length())
    kc = torch.randn(b * live + 1, BS, HKV, D, device=DEV, dtype=DT)
    vc = torch.randn_like(kc)
    table = torch.full((b, width), b * live, dtype=torch.int32)
    table[:, :live] = torch.randperm(b * live, generator=g).to(torch.int32).view(b, live)
    table = table.to(DEV)
    ctxs = torch.full((b,), ctx, device=DEV, dtype=torch.int32)
    node_par = random_trees(b, n, min(n, 8), g) if n else torch.zeros(b, 0, dtype=torch.int32)
    chunk_par, _ = verify_chunk_layout(node_par)
    chunk_par = chunk_par.to(DEV, torch.int32)
    t = n + 1
    cu = torch.arange(b + 1, device=DEV, dtype=torch.int32) * t
    q = torch.randn(b * t, HQ, D, device=DEV, dtype=DT)
    flat = chunk_par.reshape(-1)
    anc = tree_ancestors(chunk_par) if n else None
    args = (q, kc, vc, table, ctxs, cu, flat, D ** -0.5)
    row = {"default_us": 1000 * cuda_ms(lambda: paged_tree_attention(*args, anc), LAYERS)}
    want = paged_tree_attention(*args, anc).float()
    for sk, block_m in variants:
        kw = {"invariant": True, "block_m": block_m, "split_keys": sk}
        us = 1000 * cuda_ms(lambda: paged_tree_attention(*args, **kw), LAYERS)
        got = paged_tree_attention(*args, **kw).float()
        row[f"invariant_s{sk}_m{block_m}"] = {
            "us": us, "ratio": us / row["default_us"],
            "split": _plan_invariant(b * t, b, HQ // HKV, HKV, width * BS, DEV, None, block_m,
                                     None, sk)[3],
            "max_abs_diff": (got - want).abs().max().item()}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ctxs", default="1024,4096")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--nodes", default="0,4,16,64")
    ap.add_argument("--split-keys", default=str(INVARIANT_SPLIT_KEYS),
                    help="key chunk sizes to time (the checks use the first)")
    ap.add_argument("--block-m", default=f"{INVARIANT_BLOCK_M},64",
                    help="query tile rows to time (the checks use the first)")
    ap.add_argument("--skip-timing", action="store_true")
    a = ap.parse_args()
    split_keys = [int(x) for x in a.split_keys.split(",")]
    block_ms = [int(x) for x in a.block_m.split(",")]
    variants = [(sk, m) for sk in split_keys for m in block_ms]
    inv_kw = {"split_keys": split_keys[0], "block_m": block_ms[0]}
    ctxs = [int(x) for x in a.ctxs.split(",")]
    positions = [p for c in ctxs for p in (c - 1, c + 40)]
    res: dict = {"device": torch.cuda.get_device_name(), "shape": [HQ, HKV, D, BS],
                 "invariant_kwargs": inv_kw}
    res["invariant"] = row_checks(positions, 0, invariant=True, **inv_kw)
    mixed = mixed_batch(positions)
    inv = {"invariant": True, **inv_kw}
    res["split_equals_single"] = same_bits(mixed, {**inv, "split": True},
                                           {**inv, "split": False})
    res["control_default"] = row_checks(positions, 0)
    res["block_m64_equals_block_m16"] = same_bits(mixed, {**inv, "block_m": 64},
                                                  {**inv, "block_m": 16})
    ok = all(all(v) for v in res["invariant"].values()) and res["split_equals_single"]
    res["invariant_ok"] = ok
    print(json.dumps(res), flush=True)
    if not a.skip_timing:
        res["times"] = {}
        for ctx in ctxs:
            for b in (int(x) for x in a.batches.split(",")):
                for n in (int(x) for x in a.nodes.split(",")):
                    row = timings(ctx, b, n, variants)
                    res["times"][f"ctx{ctx}_b{b}_n{n}"] = row
                    inv = "  ".join(
                        f"s{sk}m{m} {r['us']:7.2f} us x{r['ratio']:.2f}"
                        f"{' split' if r['split'] else ''} |d| {r['max_abs_diff']:.2g}"
                        for sk, m in variants for r in [row[f"invariant_s{sk}_m{m}"]])
                    print(f"ctx {ctx:5d} b {b:3d} nodes {n:3d}: default "
                          f"{row['default_us']:8.2f} us  invariant {inv}", flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
