"""What batch invariance costs the CPU reference path: plain decode tokens/s of a shipped
tiny model through the Verifier, per batch and dtype, with the current kernels against
another kernels module (e.g. a copy of kernels/reference.py from before, `git show
REV:kernels/reference.py > /tmp/old_ref.py`), in alternating passes.

    python -P bench/invariance_cost_cpu.py --against /tmp/old_ref.py [--model tiny-code]
        [--batches 1,8] [--steps 48] [--ctx 200] [--passes 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from types import ModuleType, SimpleNamespace

import torch

from treespec.common.model.paths import resolve_model
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.runtime.kv_cache import SeqPages
from treespec.kernels import reference
from treespec.kernels.dispatch import KERNEL_NAMES
from treespec.verify_service.verifier import Verifier, VerifyBatch


def load_ops(path: str) -> SimpleNamespace:
    """The reference's functions, those the file at path defines in their place."""
    spec = importlib.util.spec_from_file_location("against_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return SimpleNamespace(**{n: getattr(mod, n, getattr(reference, n)) for n in KERNEL_NAMES})


def decode_rate(model: Qwen3Model, ops: ModuleType, batch: int, ctx: int, steps: int) -> float:
    """Plain decode tokens/s of batch sequences with ctx-token prompts."""
    cache = model.new_cache(batch * (ctx + steps) // 16 + 4 * batch + 8, 16)
    ver = Verifier(model, cache, ops, capture=False, max_batch=batch)
    g = torch.Generator().manual_seed(0)
    pages = [SeqPages() for _ in range(batch)]
    prompts = [torch.randint(0, model.spec.vocab_size, (ctx,), generator=g).tolist()
               for _ in range(batch)]
    roots, _ = ver.prefill(pages, prompts)
    ver.step(VerifyBatch(pages, roots))
    t0 = time.perf_counter()
    for _ in range(steps):
        roots = ver.step(VerifyBatch(pages, roots)).bonus
    return batch * steps / (time.perf_counter() - t0)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--against", required=True, help="a kernels module file to compare with")
    a.add_argument("--model", default="tiny-code")
    a.add_argument("--batches", default="1,8")
    a.add_argument("--dtypes", default="float32,bfloat16")
    a.add_argument("--steps", type=int, default=48)
    a.add_argument("--ctx", type=int, default=200)
    a.add_argument("--passes", type=int, default=3)
    a.add_argument("--threads", type=int, default=1)
    a.add_argument("--out", default=None)
    args = a.parse_args()
    torch.set_num_threads(args.threads)
    other = load_ops(args.against)
    rows = []
    for dt in args.dtypes.split(","):
        model = Qwen3Model.from_pretrained(resolve_model(args.model), getattr(torch, dt))
        for b in map(int, args.batches.split(",")):
            now, then = [], []
            for _ in range(args.passes):        # alternating: the machine's drift hits both
                now.append(decode_rate(model, reference, b, args.ctx, args.steps))
                then.append(decode_rate(model, other, b, args.ctx, args.steps))
            row = dict(dtype=dt, batch=b, tok_s=statistics.median(now),
                       against_tok_s=statistics.median(then))
            row["ratio"] = row["tok_s"] / row["against_tok_s"]
            rows.append(row)
            print(f"{dt:9s} b{b:<3d} {row['tok_s']:8.1f} tok/s against {row['against_tok_s']:8.1f}"
                  f"  x{row['ratio']:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, ctx=args.ctx, steps=args.steps,
                           threads=args.threads, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
