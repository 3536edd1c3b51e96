"""Does the verify path pick the same greedy tokens as plain decode, on the GPU?

    python bench/divergence.py --out FILE [--shape qwen3-8b] [--steps 64]

For each dtype (bf16, fp32), one random-weight model and one prompt, three
in-process runs through the fixed-shape Verifier:
  plain   N = 0 every step (the baseline);
  reject  a chain of 4 that is always wrong: every token is the bonus of a [root + 4]
          verify forward, so only the forward's shape differs from plain;
  oracle  a chain of 4 proposing plain's own continuation (what the replay
          instrument does), so accepted tokens' KV comes from tree rows.
It reports where reject and oracle first differ from plain and, at that position,
plain's top-2 logit gap (fp32 logits of the plain prefix): a gap near the bf16
rounding of the logits means a reduction-order tie break, a large gap means a bug.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


import torch

from profile_step import random_model
from treespec.common.runtime.devices import pick_device
from treespec.common.runtime.forward_batch import build_forward_batch, chain_chunk
from treespec.common.runtime.kv_cache import SeqPages
from treespec.common.spec.tree import TreeBatch
from treespec.kernels.dispatch import select
from treespec.verify_service.verifier import Verifier, VerifyBatch

DEPTH = 4


def generate(ver: Verifier, prompt: list[int], steps: int, mode: str,
             ref: list[int] | None) -> tuple[list[int], int]:
    """Greedy tokens after the prompt (the prefill's first), and tokens accepted."""
    pages = [SeqPages()]
    roots, _ = ver.prefill(pages, [prompt])
    out, accepted = [roots[0]], 0
    parents = torch.arange(-1, DEPTH - 1, dtype=torch.int32).view(1, DEPTH)
    while len(out) < steps:
        if mode == "plain":
            r = ver.step(VerifyBatch(pages, [out[-1]], None, 0))
        else:
            k = len(out)
            prop = ref[k:k + DEPTH] if mode == "oracle" and ref[:k] == out else []
            prop = (prop + [ver.model.spec.vocab_size - 1] * DEPTH)[:DEPTH]
            tokens = torch.tensor([prop], dtype=torch.int32)
            r = ver.step(VerifyBatch(pages, [out[-1]], TreeBatch(tokens, parents), DEPTH))
            out += [prop[i] for i in r.accepted[0]]
            accepted += len(r.accepted[0])
        out.append(r.bonus[0])
    ver.cache.release(pages[0])
    return out[:steps], accepted


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@torch.inference_mode()
def top2_gap(ver: Verifier, ids: list[int]) -> dict:
    """fp32 logits of the last position of a fresh prefill of ids: top-2 and gap."""
    pages = [SeqPages()]
    fb = build_forward_batch([chain_chunk(pages[0], ids)], ver.cache)
    hidden, _ = ver.model(fb, ver.cache, ver.ops)
    logits = ver.model.logits(hidden[fb.last])[0]
    ver.cache.release(pages[0])
    v, i = logits.topk(2)
    return {"top2_ids": i.tolist(), "top2": v.tolist(), "gap": float(v[0] - v[1]),
            "logit_std": float(logits.std())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--plant", action="store_true", help="bench.shapes' planted successor map")
    a = ap.parse_args()
    dev = pick_device(a.device)
    ops = select(dev, "auto")
    res: dict = {"shape": a.shape, "ctx": a.ctx, "steps": a.steps, "plant": a.plant}
    g = torch.Generator().manual_seed(7)
    for name in a.dtypes.split(","):
        model = random_model(a.shape, dev, a.plant).to(getattr(torch, name))
        model.inv_freq = model.inv_freq.float()
        prompt = torch.randint(0, model.spec.vocab_size, (a.ctx,), generator=g).tolist()
        cache = model.new_cache(4 * (-(-(a.ctx + a.steps + 2 * DEPTH + 8) // 16)) + 8, 16)
        ver = Verifier(model, cache, ops)
        plain, _ = generate(ver, prompt, a.steps, "plain", None)
        r: dict = {}
        for mode in ("reject", "oracle"):
            toks, acc = generate(ver, prompt, a.steps, mode, plain)
            j = first_diff(plain, toks)
            r[mode] = {"first_diff": j, "accepted": acc, "identical": j is None}
            if j is not None:
                r[mode]["at_diff"] = dict(top2_gap(ver, prompt + plain[:j]), plain=plain[j],
                                          other=toks[j])
        res[name] = r
        print(name, json.dumps(r), flush=True)
        del ver, cache, model
        torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
