"""The DFlash proposer on a GPU with the Triton kernels and its CUDA graphs: in fp32 it
drafts the chains and trees the CPU reference path drafts (the block's non-causal
attention through the Triton tree attention); in bf16 its trees are valid. Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch

from treespec.common.spec.tree import PRESETS, validate_tree
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.dflash_proposer import DFlashProposer
from treespec.kernels.availability import triton_available
from test_dflash import _features, dflash_dir, target4  # noqa: F401  (the module's fixtures)
from tests_data import tp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available()
                                or not triton_available(torch.device("cuda:0")),
                                reason="needs CUDA and Triton")


def _trees(path, target, env, device, dtype, kernels, inputs):
    prop = DFlashProposer.from_config(DraftConfig(
        method="dflash", envelope=env, model=str(path), target_embeddings=str(target),
        device=device, dtype=dtype, kernels=kernels, num_blocks=256, block_size=16))
    got = []
    for s, (toks, rows) in inputs.items():   # full update, then a delta of 3 tokens
        prop.update(s, toks[:-3], len(toks) - 3, [], rows[:-3])
    got.append(tp(prop.propose(list(inputs))))
    for s, (toks, rows) in inputs.items():
        prop.update(s, toks, 3, [], rows[-3:])
    got.append(tp(prop.propose(list(inputs))))
    return got


@pytest.mark.parametrize("envelope", ["block8", "tree-small"])
def test_triton_blocks_match_the_cpu_reference(dflash_dir, target4, envelope):
    env = PRESETS[envelope]
    g = torch.Generator().manual_seed(2)
    inputs = {}
    for s, n in ((1, 9), (2, 40), (3, 5), (4, 70)):
        toks = torch.randint(0, 95, (n,), generator=g).tolist()
        f = _features(target4, toks)
        inputs[s] = (toks, torch.cat([torch.zeros(1, f.shape[1]), f[:-1]]))
    want = _trees(dflash_dir, target4, env, "cpu", "float32", "reference", inputs)
    fp32 = _trees(dflash_dir, target4, env, "cuda:0", "float32", "triton", inputs)
    bf16 = _trees(dflash_dir, target4, env, "cuda:0", "bfloat16", "triton", inputs)
    for (wt, wp), (ft, fp), (bt, bp) in zip(want, fp32, bf16):
        assert torch.equal(ft, wt) and torch.equal(fp, wp)
        assert validate_tree(bt, bp, env.num_nodes, 96) is None
