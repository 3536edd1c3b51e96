"""The EAGLE-3 proposer on a GPU with the Triton kernels: in fp32 it drafts the trees the
CPU reference path drafts; in bf16 its trees are valid and mostly lead with the same
token. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from treespec.common.spec.sampling import SamplingParams
from treespec.common.spec.tree import PRESETS, validate_tree
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.eagle3_proposer import Eagle3Proposer
from treespec.draft_service.proposer import RowSampling
from treespec.kernels.availability import triton_available
from test_eagle3 import _inputs, head_dir  # noqa: F401  (head_dir: the module's fixture)
from tests_data import tp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available()
                                or not triton_available(torch.device("cuda:0")),
                                reason="needs CUDA and Triton")


def _trees(path, env, device, dtype, kernels, inputs, sampling=None, whole=False):
    prop = Eagle3Proposer.from_config(DraftConfig(
        method="eagle3", envelope=env, model=str(path), device=device, dtype=dtype,
        kernels=kernels, num_blocks=256, block_size=16))
    got = []
    for s, (toks, rows) in inputs.items():   # full update, then a delta of 3 tokens
        prop.update(s, toks[:-3], len(toks) - 3, [], rows[:-3])
    got.append(prop.propose(list(inputs), sampling))
    for s, (toks, rows) in inputs.items():
        prop.update(s, toks, 3, [0], rows[-3:])
    got.append(prop.propose(list(inputs), sampling))
    return got if whole else [tp(t) for t in got]


@pytest.mark.parametrize("envelope", ["chain4", "tree-small", "tree-wide"])
def test_triton_trees_match_the_cpu_reference(head_dir, envelope):
    env = PRESETS[envelope]
    inputs = {s: _inputs(30 + s, n) for s, n in ((1, 9), (2, 40), (3, 5), (4, 70))}
    want = _trees(head_dir, env, "cpu", "float32", "reference", inputs)
    fp32 = _trees(head_dir, env, "cuda:0", "float32", "triton", inputs)
    bf16 = _trees(head_dir, env, "cuda:0", "bfloat16", "triton", inputs)
    for (wt, wp), (ft, fp), (bt, bp) in zip(want, fp32, bf16):
        assert torch.equal(ft, wt) and torch.equal(fp, wp)
        assert validate_tree(bt, bp, env.num_nodes, 96) is None
        assert (bt[:, 0] == wt[:, 0]).sum() >= 3


@pytest.mark.parametrize("envelope", ["chain4", "tree-small"])
def test_triton_sampled_trees_match_the_cpu_reference(head_dir, envelope):
    """Sampling rows, coupled and rejection (top-k 20: the candidates' scores in one
    kernel, the noise hashed in another), draft in fp32 what the CPU reference drafts."""
    env = PRESETS[envelope]
    inputs = {s: _inputs(30 + s, n) for s, n in ((1, 9), (2, 40), (3, 5), (4, 70))}
    sampling = [RowSampling(SamplingParams(0.8, 20, 0.95, 0.0, 11 * s), rejection=s % 2 == 0)
                for s in inputs]
    want = _trees(head_dir, env, "cpu", "float32", "reference", inputs, sampling, True)
    got = _trees(head_dir, env, "cuda:0", "float32", "triton", inputs, sampling, True)
    for w, g in zip(want, got):
        assert torch.equal(g.tokens.cpu(), w.tokens) and torch.equal(g.parents.cpu(), w.parents)
        torch.testing.assert_close(g.q_probs.cpu(), w.q_probs, atol=1e-4, rtol=1e-3)
        live = w.q_probs > 0
        assert live.any() and torch.equal(g.q_ids.cpu()[live], w.q_ids[live])
