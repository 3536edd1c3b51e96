"""Triton kernels on a GPU at Qwen3-8B attention shapes: correctness against
kernels/reference.py, and timings of paged tree attention against torch SDPA over the
same live keys.

    python bench/gpu_kernel_check.py --out kernels.json

Shapes: bf16, head_dim 128, 32 q heads / 8 kv heads, context 1024, block_size 16,
batch 1 and 8, trees of N = 0 (decode), 4, 16, 32, 64 random nodes (chunk = root +
N). Times are medians of CUDA-graph replays (the engine's mode); eager attention
time, Python launch included, is reported too. SDPA gets the live keys pre-gathered
into dense [B, H, S, D] tensors with a boolean tree mask (the gather is timed
separately as "sdpa+gather"). Runs in well under two minutes on an H200; exits
non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


from treespec.kernels import reference as ref
from treespec.kernels import triton_backend as tb

HQ, HKV, D, BS, CTX, LAYERS = 32, 8, 128, 16, 1024, 36
DTYPE = torch.bfloat16


def _median_us(ms) -> float:
    return float(ms[0] if isinstance(ms, (list, tuple)) else ms) * 1e3


def bench(fn, reps: int = 100) -> float:
    """Median microseconds of fn replayed in a CUDA graph (how the engine runs it:
    no Python launch overhead), by triton.testing.do_bench_cudagraph; falls back to
    eager timing if fn cannot be captured."""
    from triton.testing import do_bench_cudagraph
    try:
        return _median_us(do_bench_cudagraph(fn, rep=reps, quantiles=[0.5]))
    except Exception:                                    # noqa: BLE001
        torch.cuda.synchronize()
        return bench_eager(fn, reps)


def bench_eager(fn, reps: int = 100) -> float:
    """Median microseconds of fn launched from Python, by triton.testing.do_bench."""
    from triton.testing import do_bench
    return _median_us(do_bench(fn, warmup=10, rep=reps, quantiles=[0.5]))


def random_tree(n: int, g: torch.Generator) -> list[int]:
    return [-1 if i == 0 else int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]


def tree_case(batch: int, n: int, g: torch.Generator, dev: torch.device) -> dict:
    """Caches with shuffled pages, `batch` sequences of CTX committed slots and a
    [root, n nodes] chunk each (the chunk's K/V already in its slots)."""
    t = n + 1
    per_seq = math.ceil((CTX + t) / BS)
    nb = batch * per_seq + 7
    perm = torch.randperm(nb, generator=g)
    table = perm[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    parents = []
    for _ in range(batch):
        parents += [-1] + [p + 1 for p in random_tree(n, g)]
    kc = torch.randn(nb, BS, HKV, D, generator=g).to(dev, DTYPE)
    vc = torch.randn(nb, BS, HKV, D, generator=g).to(dev, DTYPE)
    q = torch.randn(batch * t, HQ, D, generator=g).to(dev, DTYPE)
    i32 = dict(dtype=torch.int32, device=dev)
    return dict(q=q, k_cache=kc, v_cache=vc, block_tables=table.to(dev),
                context_lens=torch.full((batch,), CTX, **i32),
                cu_q=torch.arange(0, batch * t + 1, t, **i32),
                chunk_parents=torch.tensor(parents, **i32), scale=D ** -0.5)


def sdpa_inputs(c: dict, batch: int, t: int) -> tuple:
    """Dense live K/V [B, HKV, CTX + t, D] and the [B, 1, t, CTX + t] visibility mask."""
    s = CTX + t
    slots = torch.stack([ref.gather_slots(c["block_tables"][b], 0, s, BS) for b in range(batch)])
    flat_k = c["k_cache"].view(-1, HKV, D)
    flat_v = c["v_cache"].view(-1, HKV, D)
    mask = torch.ones(batch, 1, t, s, dtype=torch.bool, device=slots.device)
    for b in range(batch):
        mask[b, 0, :, CTX:] = ref.chunk_mask(c["chunk_parents"][b * t:(b + 1) * t])
    q = c["q"].view(batch, t, HQ, D).transpose(1, 2)
    return slots, flat_k, flat_v, q, mask


def check_attention(g: torch.Generator, dev: torch.device, rows: list, ok: list) -> None:
    for batch in (1, 8):
        for n in (0, 4, 16, 32, 64):
            t = n + 1
            c = tree_case(batch, n, g, dev)
            out = tb.paged_tree_attention(**c)
            want = ref.paged_tree_attention(**c)
            err = (out.float() - want.float()).abs().max().item()
            slots, fk, fv, q, mask = sdpa_inputs(c, batch, t)
            k = fk[slots].transpose(1, 2).contiguous()
            v = fv[slots].transpose(1, 2).contiguous()
            sd = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c["scale"],
                                                enable_gqa=True)
            sd_err = (sd.transpose(1, 2).reshape(-1, HQ, D).float() - want.float()).abs().max().item()

            def gathered():
                kk = fk[slots].transpose(1, 2)
                vv = fv[slots].transpose(1, 2)
                return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask,
                                                      scale=c["scale"], enable_gqa=True)

            us = bench(lambda: tb.paged_tree_attention(**c))
            us_eager = bench_eager(lambda: tb.paged_tree_attention(**c))
            us_sdpa = bench(lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=c["scale"], enable_gqa=True))
            us_gather = bench(gathered)
            live_bytes = batch * (CTX + t) * HKV * D * 2 * 2
            good = err < 3e-2
            ok.append(good)
            rows.append(dict(kernel="paged_tree_attention", batch=batch, nodes=n,
                             max_err=err, sdpa_max_err=sd_err, triton_us=us,
                             triton_eager_us=us_eager, sdpa_us=us_sdpa,
                             sdpa_gather_us=us_gather, kv_gbps=live_bytes / us / 1e3,
                             per_step_36_layers_ms=us * LAYERS / 1e3, ok=good))


def check_graph(g: torch.Generator, dev: torch.device, rows: list, ok: list) -> None:
    """Capture the attention in a CUDA graph (it must not sync with the host), then
    replay on new inputs written into the captured tensors."""
    c = tree_case(8, 16, g, dev)
    tb.paged_tree_attention(**c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tb.paged_tree_attention(**c)
    c2 = tree_case(8, 16, g, dev)
    for name in ("q", "k_cache", "v_cache", "block_tables", "chunk_parents"):
        c[name].copy_(c2[name])
    graph.replay()
    err = (out.float() - ref.paged_tree_attention(**c2).float()).abs().max().item()
    good = err < 3e-2
    ok.append(good)
    rows.append(dict(kernel="paged_tree_attention (CUDA graph replay)", batch=8, nodes=16,
                     max_err=err, ok=good))


def check_kv(g: torch.Generator, dev: torch.device, rows: list, ok: list) -> None:
    for batch, n in ((1, 64), (8, 64)):
        t = batch * (n + 1)
        nb = batch * math.ceil((CTX + n + 1) / BS) + 3
        kc = torch.randn(nb, BS, HKV, D, generator=g).to(dev, DTYPE)
        vc = torch.randn(nb, BS, HKV, D, generator=g).to(dev, DTYPE)
        qkv = torch.randn(t, HQ + 2 * HKV, D, generator=g).to(dev, DTYPE)
        k, v = qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
        slots = torch.randperm(nb * BS, generator=g)[:t].to(dev)
        wk, wv = kc.clone(), vc.clone()
        ref.write_kv(wk, wv, k, v, slots)
        tb.write_kv(kc, vc, k, v, slots)
        good = torch.equal(kc, wk) and torch.equal(vc, wv)
        ok.append(good)
        us = bench(lambda: tb.write_kv(kc, vc, k, v, slots))
        us_ref = bench(lambda: ref.write_kv(kc, vc, k, v, slots))
        rows.append(dict(kernel="write_kv", batch=batch, nodes=n, tokens=t, exact=good,
                         triton_us=us, reference_us=us_ref, ok=good))

    for batch, depth in ((1, 8), (8, 8)):
        per_seq = math.ceil((CTX + 65) / BS)
        nb = batch * per_seq
        kc = torch.randn(LAYERS, nb, BS, HKV, D, generator=g).to(dev, DTYPE)
        vc = torch.randn(LAYERS, nb, BS, HKV, D, generator=g).to(dev, DTYPE)
        acc = torch.full((batch, depth), -1, dtype=torch.int32)
        num = torch.randint(1, depth + 1, (batch,), generator=g, dtype=torch.int32)
        for b in range(batch):
            acc[b, :num[b]] = torch.sort(torch.randperm(64, generator=g)[:num[b]]).values.int()
        kv = torch.full((batch,), CTX, dtype=torch.int32)
        seq, src, dst = path_moves(acc, num, CTX)
        seq, src, dst = seq.to(dev), src.to(dev), dst.to(dev)
        table = torch.randperm(nb, generator=g).view(batch, per_seq).to(dev)
        fs, fd = table[seq, src // BS] * BS + src % BS, table[seq, dst // BS] * BS + dst % BS
        wk, wv = kc.clone(), vc.clone()
        ref.compact_kv(wk, wv, fs, fd)
        tb.compact_kv(kc, vc, fs, fd)
        good = torch.equal(kc, wk) and torch.equal(vc, wv)
        ok.append(good)
        us = bench(lambda: tb.compact_kv(kc, vc, fs, fd))
        us_ref = bench(lambda: ref.compact_kv(kc, vc, fs, fd))
        rows.append(dict(kernel="compact_kv", batch=batch, layers=LAYERS, moves=int(fs.numel()),
                         exact=good, triton_us=us, reference_us=us_ref, ok=good))


def path_moves(accepted: torch.Tensor, num: torch.Tensor, kv_len: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(seq, src, dst) sequence-local slots moving each accepted path after its root."""
    b, d = accepted.shape
    i = torch.arange(d).expand(b, d)
    src, dst = kv_len + 1 + accepted.long(), kv_len + 1 + i
    keep = (i < num.long().unsqueeze(1)) & (src != dst)
    return torch.arange(b).unsqueeze(1).expand(b, d)[keep], src[keep], dst[keep]


def check_accept(g: torch.Generator, dev: torch.device, rows: list, ok: list) -> None:
    for batch, n, depth in ((1, 64, 8), (8, 64, 8), (64, 32, 6)):
        parents = torch.tensor([random_tree(n, g) for _ in range(batch)], dtype=torch.int32)
        tokens = torch.randint(0, 3, (batch, n), generator=g, dtype=torch.int32)
        target = torch.randint(0, 3, (batch, n + 1), generator=g)
        args = (tokens.to(dev), parents.to(dev), target.to(dev), depth)
        got, want = tb.accept_greedy(*args), ref.accept_greedy(*args)
        good = all(torch.equal(x, y) for x, y in zip(got, want))
        ok.append(good)
        rows.append(dict(kernel="accept_greedy", batch=batch, nodes=n, depth=depth, exact=good,
                         triton_us=bench(lambda: tb.accept_greedy(*args)),
                         reference_us=bench(lambda: ref.accept_greedy(*args)), ok=good))


def table(rows: list) -> str:
    keys = ["kernel", "batch", "nodes", "max_err", "triton_us", "triton_eager_us", "sdpa_us",
            "sdpa_gather_us",
            "reference_us", "kv_gbps", "ok"]
    out = [" | ".join(keys)]
    for r in rows:
        cells = []
        for k in keys:
            x = r.get(k, "")
            cells.append(f"{x:.3g}" if isinstance(x, float) else str(x))
        out.append(" | ".join(cells))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(args.seed)
    rows: list[dict] = []
    ok: list[bool] = []
    t0 = time.time()
    check_attention(g, dev, rows, ok)
    check_graph(g, dev, rows, ok)
    check_kv(g, dev, rows, ok)
    check_accept(g, dev, rows, ok)
    import triton
    result = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                  triton=triton.__version__, shapes=dict(q_heads=HQ, kv_heads=HKV, head_dim=D,
                  block_size=BS, context=CTX, dtype=str(DTYPE)), rows=rows, all_ok=all(ok),
                  seconds=time.time() - t0)
    print(table(rows))
    print(f"all ok: {all(ok)}  ({result['seconds']:.1f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
