"""The EAGLE-3 proposer on a GPU with the Triton kernels: in fp32 it drafts the trees the
CPU reference path drafts; in bf16 its trees are valid and mostly lead with the same
token. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from common.tree import PRESETS, validate_tree
from draft_service.config import DraftConfig
from draft_service.eagle3_proposer import Eagle3Proposer
from kernels.dispatch import triton_available
from test_eagle3 import _inputs, head_dir  # noqa: F401  (head_dir: the module's fixture)
from tests_data import tp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available()
                                or not triton_available(torch.device("cuda:0")),
                                reason="needs CUDA and Triton")


def _trees(path, env, device, dtype, kernels, inputs):
    prop = Eagle3Proposer.from_config(DraftConfig(
        method="eagle3", envelope=env, model=str(path), device=device, dtype=dtype,
        kernels=kernels, num_blocks=256, block_size=16))
    got = []
    for s, (toks, rows) in inputs.items():   # full update, then a delta of 3 tokens
        prop.update(s, toks[:-3], len(toks) - 3, [], rows[:-3])
    got.append(tp(prop.propose(list(inputs))))
    for s, (toks, rows) in inputs.items():
        prop.update(s, toks, 3, [0], rows[-3:])
    got.append(tp(prop.propose(list(inputs))))
    return got


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
