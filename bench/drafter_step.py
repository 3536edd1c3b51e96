"""Where a drafter's step time goes, on the GPU, in process (no services, no hop).

    python bench/drafter_step.py --out DIR/drafter_step.json [--work /tmp/treespec-drafters]
        [--methods model,eagle3] [--envelopes chain4,tree-small] [--batches 1,8,32,64]

Per (method, envelope, batch): B sequences with --ctx-token prompts are caught up,
then steady-state steps each bring 4 new committed units per row (as after 3 accepted
and a bonus; random tokens, so no scratch KV is kept) and time the proposer's step
(synchronised): the rows' updates (their new tokens and hidden states, as the draft
engine applies them: update_ms) and the whole ``propose`` (propose_ms covers both),
its parts (KV moves, page reservation, the graph call = input staging + replay +
output copies), the captured graph's replay alone (device time), and the same for
a batch whose rows all sample (T 0.6, top-k 20, top-p 0.95, rejection q). At batch
1 and 32 a profiler table sums the replay's kernels by kind, so launch gaps =
replay - kernel time. Random weights of the
benchmark's shapes (bench/drafters.py makes the checkpoints); nothing here is a
result for users. `--target-shape tiny --draft-shape tiny --device cpu` smoke-runs it.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path


import torch

from drafters import checkpoints, pages, shape_args, target_name
from inproc_bench import replay_ms
from treespec.common.spec.sampling import SamplingParams, filter_width
from treespec.common.spec.tree import envelope_from
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.proposer import RowSampling
from treespec.draft_service.registry import PROPOSERS

KINDS = ("gemv", "linear", "attention", "norm", "rope", "silu", "softmax", "sort", "topk",
         "gather", "cat", "copy", "fill", "index", "scatter")


class Timed:
    """Wraps a drafter's graph call so its time lands in acc['graph_call']."""

    def __init__(self, inner, acc: dict) -> None:
        self.inner, self.acc = inner, acc

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __call__(self, *a, **k):
        return _timed(self.inner, self.acc, "graph_call", *a, **k)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, acc: dict, key: str, *a, **k):
    sync()
    t0 = time.perf_counter()
    r = fn(*a, **k)
    sync()
    acc[key] += 1000 * (time.perf_counter() - t0)
    return r


def wrap(prop, acc: dict) -> None:
    for name in ("_before_step", "_reserve", "_prefill", "_drafted"):
        f = getattr(prop, name)
        setattr(prop, name, lambda *a, _f=f, _n=name, **k: _timed(_f, acc, _n, *a, **k))
    prop.graphs = Timed(prop.graphs, acc)


def kernel_kinds(graph, steps: int = 5) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    kinds: dict = defaultdict(float)
    count = 0
    for e in prof.key_averages():
        if e.device_time_total <= 0:
            continue
        name = e.key.lower()
        kind = next((k for k in KINDS if k in name), "other")
        kinds[kind] += e.device_time_total / 1000 / steps
        count += e.count
    return {"kernel_ms": round(sum(kinds.values()), 4), "kernels": count // steps,
            "by_kind_ms": {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}}


def host_ops(step, steps: int = 5, top: int = 15) -> dict:
    """Where a whole step's host time goes: the CPU-side ops and CUDA runtime calls with
    the most self time, ms per step (synchronisation shows as the waits' time)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return {e.key: [round(e.self_cpu_time_total / 1000 / steps, 4), e.count // steps]
            for e in ops}


def run(prop, method: str, b: int, ctx: int, steps: int, sampled: bool, profile: bool,
        g: torch.Generator, depth: int = 0) -> dict:
    vocab = prop.vocab_size
    feat = getattr(prop, "feature_size", 0)
    ids = list(range(10_000 * (b + 1), 10_000 * (b + 1) + b))
    toks = {s: torch.randint(0, vocab, (ctx,), generator=g).tolist() for s in ids}

    def hidden(n: int):
        return torch.randn(n, feat, generator=g) if feat else None

    for s in ids:
        prop.update(s, toks[s], ctx, [], hidden(ctx))
    samp = [RowSampling(SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=s),
                        rejection=True) for s in ids] if sampled else None

    gpu_rows = bool(feat) and torch.cuda.is_available()

    def news() -> list:             # 4 new committed units a row (3 accepted + a bonus),
        h = hidden(4 * len(ids))    # the rows one after another in one pinned buffer, as
        if gpu_rows:                # the carrier's shared buffer holds them
            h = h.pin_memory()
        return [(s, torch.randint(0, vocab, (4,), generator=g).tolist(),
                 None if h is None else h[4 * i:4 * i + 4]) for i, s in enumerate(ids)]

    def apply(rows: list) -> None:  # what the draft engine does with them: timed
        if gpu_rows:                # DraftEngine._stage_hidden: async copies, one wait
            rows = [(s, new, h.to(prop.head.device, non_blocking=True)) for s, new, h in rows]
            torch.cuda.current_stream().synchronize()
        for s, new, h in rows:
            toks[s] += new
            prop.update(s, toks[s], 4, [], h)

    def advance() -> None:
        apply(news())
    prop.propose(ids, samp, depth)                    # the prompts' catch-up (eager prefill)
    acc: dict = defaultdict(float)
    inner = prop.graphs
    wrap(prop, acc)
    walls, updates = [], []
    try:
        for i in range(steps + 3):
            rows = news()
            if i == 3:
                acc.clear()
            sync()
            t0 = time.perf_counter()
            apply(rows)
            sync()
            t1 = time.perf_counter()
            prop.propose(ids, samp, depth)
            sync()
            if i >= 3:
                walls.append(1000 * (time.perf_counter() - t0))
                updates.append(1000 * (t1 - t0))
    finally:
        prop.graphs = inner
        for name in ("_before_step", "_reserve", "_prefill", "_drafted"):
            prop.__dict__.pop(name, None)
    if profile and not sampled:     # the same steps again, under the profiler

        acc["host_ops"] = host_ops(lambda: (advance(), prop.propose(ids, samp, depth)))
    family = (("step-sampled", filter_width([r.params for r in samp])) if sampled
              else ("step", depth) if depth else "step")
    key = min((k for k in inner.buckets.graphs if k[0] == family and k[1] >= b),
              key=lambda k: (k[1], -k[2]), default=None)
    graph = inner.buckets.graphs[key] if key else None
    out = {"propose_ms": sorted(walls)[len(walls) // 2],
           "update_ms": sorted(updates)[len(updates) // 2],
           **{k.lstrip("_") + "_ms": round(v / steps, 4) for k, v in acc.items()
              if k != "host_ops"}}
    if "host_ops" in acc:
        out["host_ops_ms_count"] = acc["host_ops"]
    if graph is not None and graph.graph is not None:
        out["replay_ms"] = replay_ms(graph.graph)
        out["graph_key"] = list(map(str, key))
        if profile:
            out["profile"] = kernel_kinds(graph.graph)
    for s in ids:
        prop.release(s)
    return out


def main() -> None:
    ap = shape_args(__doc__.splitlines()[0])
    ap.add_argument("--methods", default="model,eagle3")
    ap.add_argument("--envelopes", default="chain4,tree-small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--depth", type=int, default=0,
                    help="the verify's budget depth for greedy steps (0: the envelope's)")
    a = ap.parse_args()
    a.max_tokens = a.steps * 4 + 16
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    checkpoints(a, work)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "ctx": a.ctx, "rows": {}}
    g = torch.Generator().manual_seed(0)
    for method in a.methods.split(","):
        for envelope in a.envelopes.split(","):
            model = work / {"model": "draft"}.get(method, method)
            t0 = time.perf_counter()
            prop = PROPOSERS[method].from_config(DraftConfig(
                method=method, envelope=envelope_from(envelope), model=str(model),
                target_embeddings=str(work / target_name(a)) if method != "model" else None,
                device=a.device, num_blocks=pages(a)))
            res["rows"][f"{method}:{envelope}:load_s"] = round(time.perf_counter() - t0, 1)
            for b in (int(x) for x in a.batches.split(",")):
                for sampled in (False, True):
                    key = f"{method}:{envelope}:b{b}:{'sampled' if sampled else 'greedy'}"
                    try:
                        res["rows"][key] = run(prop, method, b, a.ctx, a.steps, sampled,
                                               b in (1, 32), g, a.depth)
                    except Exception as e:      # one failure must not cost the rest
                        res["rows"][key] = {"error": f"{type(e).__name__}: {e}"}
                    print(key, json.dumps(res["rows"][key]), flush=True)
                    Path(a.out).write_text(json.dumps(res, indent=1))
            del prop
            if a.device == "cuda":
                torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
