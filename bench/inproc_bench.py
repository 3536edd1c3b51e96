"""In-process measurements: copy bandwidth (the floor), HF transformers' eager decode,
and our verify step (plain decode and trees of N nodes) on the same weights."""

from __future__ import annotations

import time

import torch

from treespec.common.runtime.kv_cache import SeqPages
from treespec.common.spec.tree import TreeBatch
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.model.config import Qwen3Spec
from treespec.kernels.dispatch import select
from treespec.verify_service.verifier import Verifier, VerifyBatch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (best of 10)."""
    if device.type != "cuda":
        nbytes = 64 << 20
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(12):
        sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del x, y
    return 2 * nbytes / best


def cuda_ms(fn, iters: int = 50) -> float:
    """Mean device ms of fn() replayed from a CUDA graph of iters calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    return replay_ms(g) / iters


def replay_ms(g: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    """Median device ms of one replay of a captured graph (events around each)."""
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[reps // 2]


def hf_decode_tok_s(hf, prompt: torch.Tensor, new_tokens: int = 32) -> float:
    """HF generate, eager, greedy: decode tokens/s excluding the prefill."""
    dev = prompt.device

    def run(n: int) -> float:
        sync(dev)
        t0 = time.perf_counter()
        hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0)
        sync(dev)
        return time.perf_counter() - t0

    run(2)
    t1 = min(run(1) for _ in range(2))
    tn = run(new_tokens + 1)
    return new_tokens / (tn - t1)


def ours_from_hf(hf, device: torch.device) -> Qwen3Model:
    spec = Qwen3Spec.from_dict(hf.config.to_dict())
    with torch.device("meta"):
        model = Qwen3Model(spec)
    model.load_hf_state(dict(hf.state_dict()), torch.bfloat16 if device.type == "cuda"
                        else torch.float32, device)
    return model.eval().requires_grad_(False)


def random_trees(b: int, n: int, depth: int, g: torch.Generator) -> torch.Tensor:
    """Valid random trees of n nodes, none deeper than depth: parents [b, n]."""
    parents = torch.full((b, n), -1, dtype=torch.int32)
    depths = torch.zeros((b, n), dtype=torch.int32)
    for i in range(1, n):
        cand = torch.randint(-1, i, (b,), generator=g)
        for r in range(b):
            c = int(cand[r])
            if c >= 0 and int(depths[r, c]) + 1 >= depth:
                c = -1
            parents[r, i] = c
            depths[r, i] = 0 if c < 0 else int(depths[r, c]) + 1
    return parents


def verify_latency_ms(model: Qwen3Model, ctx: int, batches: list[int], nodes: list[int],
                      iters: int = 30, kernels: str = "auto") -> dict[str, dict[str, float]]:
    """Median wall ms of one verify step (host prep + replay + readback) at each (B, N)
    (the median: one host hiccup among the iterations moves a mean by tenths of a ms).

    Every sequence has ctx committed tokens; trees are random (nothing is accepted
    beyond chance), and each step's kv_len is rewound so ctx stays fixed.
    """
    dev = model.device
    bs = 16
    need = max(batches) * (-(-(ctx + max(nodes) + 2) // bs)) + 8
    cache = model.new_cache(need, bs)
    verifier = Verifier(model, cache, select(dev, kernels))
    g = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {}
    for b in batches:
        pages = [SeqPages() for _ in range(b)]
        prompts = [torch.randint(0, model.spec.vocab_size, (ctx,), generator=g).tolist()
                   for _ in range(b)]
        roots, _ = verifier.prefill(pages, prompts)
        for n in nodes:
            depth = min(n, 8) if n else 0
            parents = random_trees(b, n, depth, g) if n else None
            tokens = torch.randint(0, model.spec.vocab_size, (b, n), generator=g,
                                   dtype=torch.int32) if n else None
            times = []
            for it in range(iters + 3):
                t0 = time.perf_counter()
                verifier.step(VerifyBatch(pages, roots,
                                          TreeBatch(tokens, parents) if n else None, depth))
                times.append(time.perf_counter() - t0)
                for p in pages:
                    p.kv_len = ctx
            out.setdefault(str(b), {})[str(n)] = 1000 * sorted(times[3:])[iters // 2]
            print(f"verify B={b} N={n}: {out[str(b)][str(n)]:.2f} ms", flush=True)
        for p in pages:
            cache.release(p)
    del verifier, cache
    return out
