"""The draft-model proposer on a GPU: captured steps (catch-up + expansion in one
replay) draft, in fp32, the trees the CPU reference path drafts. Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch

from treespec.common.spec.tree import envelope_from, validate_tree
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.model_proposer import ModelProposer
from treespec.kernels.availability import triton_available
from tests_data import tp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available()
                                or not triton_available(torch.device("cuda:0")),
                                reason="needs CUDA and Triton")

PROMPTS = {1: list(range(3, 12)), 2: [(5 * i) % 90 + 1 for i in range(40)], 3: [7, 8, 9]}


def _trees(path, env, device, dtype, kernels):
    prop = ModelProposer.from_config(DraftConfig(
        method="model", envelope=env, model=str(path), device=device, dtype=dtype,
        kernels=kernels, num_blocks=256, block_size=16))
    seqs = {s: list(p) for s, p in PROMPTS.items()}
    for s, toks in seqs.items():
        prop.update(s, toks, len(toks), [], None)
    got = [tp(prop.propose(list(seqs)))]
    for step in range(3):                # accept node 0 and a bonus: steady-state steps
        t, p = got[-1]
        for row, s in enumerate(seqs):
            path = [0] if int(p[row, 0]) == -1 else []
            new = [int(t[row, 0])] * len(path) + [(step * 13 + s) % 90 + 1]
            seqs[s] += new
            prop.update(s, seqs[s], len(new), path, None)
        got.append(tp(prop.propose(list(seqs))))
    return got, prop


@pytest.mark.parametrize("envelope", ["chain4", "tree-small", "tree-wide"])
def test_captured_draft_steps_match_the_cpu_reference(draft_dir, envelope):
    env = envelope_from(envelope)
    want, _ = _trees(draft_dir, env, "cpu", "float32", "reference")
    fp32, gpu = _trees(draft_dir, env, "cuda:0", "float32", "triton")
    assert gpu.graphs.buckets.batches("step")
    assert any(g.graph is not None for g in gpu.graphs.buckets.graphs.values())
    for (wt, wp), (ft, fp) in zip(want, fp32):
        assert torch.equal(ft.cpu(), wt) and torch.equal(fp.cpu(), wp)
        assert validate_tree(wt, wp, env.num_nodes, 96) is None
