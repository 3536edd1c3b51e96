"""How many kernels a step graph holds, counted on the CPU: each proposer's drafter
step and the verify step, on the shipped tiny models with the Triton kernels
interpreted. Every aten op that is not a view, and every Triton launch, is one
kernel of the CUDA graph (the H200's profile of EAGLE-3's chain4 step at b1: 163
kernels; this count then: 164). Inside a graph a small kernel costs a few
microseconds whatever it does, so the count is a proxy for the step's fixed cost
that this CPU can measure; bench/drafter_step.py and bench/profile_step.py time them.

    TRITON_INTERPRET=1 python bench/graph_ops.py [--batch 1] [--sampled] [--sites]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton.runtime.interpreter as interpreter
from torch.utils._python_dispatch import TorchDispatchMode

import treespec.common.spec.sampling
import treespec.kernels.noise
from treespec.common.model.paths import resolve_model
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.spec.sampling import DRAFT_Q, SamplingParams, filter_width
from treespec.common.spec.messages import SeqUpdate, SpecRequest
from treespec.common.spec.tree import PRESETS, TreeBatch
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.engine import DraftEngine
from treespec.kernels.dispatch import select
from treespec.common.runtime.kv_cache import SeqPages
from treespec.common.spec.sampling_batch import SamplingBatch
from treespec.verify_service.verifier import StepFamily, VerifyBatch, pack_inputs, packed_step

VIEWS = {"view", "reshape", "_unsafe_view", "expand", "slice", "unsqueeze", "squeeze",
         "as_strided", "select", "t", "transpose", "permute", "detach", "alias", "unbind",
         "split", "split_with_sizes", "narrow", "lift_fresh", "empty", "empty_like",
         "empty_strided", "view_as", "flatten", "unflatten", "chunk", "diagonal", "numpy_T",
         "scalar_tensor"}
ROOT = str(Path(__file__).resolve().parent.parent) + "/"


_ACTIVE: list[Kernels] = []          # the counter Triton launches go to
_LAUNCH = interpreter.InterpretedFunction.run


def _run(fn, *a, **k):
    if _ACTIVE:
        _ACTIVE[-1].ops["triton:" + getattr(fn.fn, "__name__", "?")] += 1
    return _LAUNCH(fn, *a, **k)


interpreter.InterpretedFunction.run = _run
# the device-dispatched kernels (the noise hash, a drafter's candidate scores) as on a GPU
treespec.kernels.noise.triton_available = treespec.common.spec.sampling.triton_available = lambda device: True


class Kernels(TorchDispatchMode):
    """Counts the kernels of what runs inside it: by op, and by call site."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.pop()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in VIEWS or (name in ("to", "_to_copy") and args and out is args[0]):
            return out                                   # no kernel
        frame, site = sys._getframe(1), None
        while frame is not None:
            path = frame.f_code.co_filename
            if "triton" in path and "interpreter" in path:
                return out                               # the interpreter's own
            if site is None and path.startswith(ROOT) and not path.endswith("graph_ops.py"):
                site = f"{path[len(ROOT):]}:{frame.f_lineno}"
            frame = frame.f_back
        self.ops[name] += 1
        self.sites[site] += 1
        return out


def drafter_step(k: Kernels, method: str, envelope: str, b: int, sampled: bool) -> None:
    """One steady step (each row brings 2 new tokens) of the shipped tiny drafter."""
    kw = {} if method == "model" else {"target_embeddings": str(resolve_model("tiny-code"))}
    name = "tiny-code-draft" if method == "model" else f"tiny-code-{method}"
    eng = DraftEngine(DraftConfig(method=method, envelope=PRESETS[envelope], device="cpu",
                                  num_blocks=4096, kernels="triton",
                                  model=str(resolve_model(name)), **kw))
    w, r = eng.info.projected_width, random.Random(0)

    def update(i: int, n: int, full: bool) -> SeqUpdate:
        sp = SamplingParams(0.6, 20, 0.95, 0.0, 7 + i) if sampled and full else None
        new = [r.randrange(6000) for _ in range(n)]
        return SeqUpdate(i, 40 + (n if not full else 0), new, full=full, sampling=sp,
                         hidden=torch.randn(n, w) if w else None)
    eng.step(SpecRequest(1, [update(i, 40, True) for i in range(b)]))
    step = eng.proposer.graphs.fn
    eng.proposer.graphs.fn = lambda *a, **kw: _counted(k, step, *a, **kw)
    eng.step(SpecRequest(2, [update(i, 2, False) for i in range(b)]))


def verify_step(k: Kernels, b: int, n: int, sampled: bool) -> None:
    """The verify's step graph over n-node chains (0: plain decode); sampled: every row
    draws (T 0.6, top-k 20), accepting by rejection sampling (a q of DRAFT_Q a node)."""
    model = Qwen3Model.from_pretrained(resolve_model("tiny-code"))
    cache = model.new_cache(64 * b + 8, 16)
    tables = [cache.blocks.allocate(8) for _ in range(b)]
    trees = None if n == 0 else TreeBatch(
        torch.randint(0, 5000, (b, n), dtype=torch.int32),
        (torch.arange(n, dtype=torch.int32) - 1).expand(b, n).contiguous())
    params, q = None, 0
    if sampled:
        params = [SamplingParams(0.6, 20, 0.95, 0.0, 7 + i) for i in range(b)]
        if n:
            q = DRAFT_Q
            trees.q_ids = torch.randint(0, 5000, (b, n, q), dtype=torch.int32)
            trees.q_probs = torch.full((b, n, q), 1.0 / q)
    batch = VerifyBatch([SeqPages(t, 40) for t in tables], [5] * b, trees, n,
                        SamplingBatch(params) if params else None)
    family = StepFamily(n, (), filter_width(params), q, 1 if q else 0)
    packed = pack_inputs(batch, b, 8, 0, family)
    _counted(k, packed_step, model, cache, select(torch.device("cpu"), "triton"), n, family,
             packed)


def _counted(k: Kernels, fn, *a, **kw):
    with k:
        return fn(*a, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sampled", action="store_true", help="rows sample (T 0.6)")
    ap.add_argument("--only", default="", help="steps whose label contains this")
    ap.add_argument("--sites", action="store_true", help="kernels by call site")
    a = ap.parse_args()
    steps = [(f"draft {m} {e}", lambda k, m=m, e=e: drafter_step(k, m, e, a.batch, a.sampled))
             for m, e in (("eagle3", "chain4"), ("model", "chain4"), ("dflash", "block16"),
                          ("eagle3", "tree-small"), ("model", "tree-small"))]
    steps += [(f"verify {n} nodes", lambda k, n=n: verify_step(k, a.batch, n, a.sampled))
              for n in (0, 4)]
    for label, run in steps:
        if a.only not in label:
            continue
        k = Kernels()
        run(k)
        print(f"{label}, b{a.batch}: {sum(k.ops.values())} kernels "
              f"({', '.join(f'{o} {c}' for o, c in k.ops.most_common(8))}, ...)", flush=True)
        if a.sites:
            for site, c in sorted(k.sites.items(), key=lambda x: str(x[0])):
                print(f"    {c:4d}  {site}")


if __name__ == "__main__":
    main()
