"""The draft's expansion as CUDA graphs hold it (batch bucket, page bucket, padding
rows on a scratch page) proposes exactly what the direct path proposes."""

from __future__ import annotations

import pytest
import torch

from common.tree import envelope_from, validate_tree
from draft_service.config import DraftConfig
from draft_service.graph_expansion import GraphExpander
from draft_service.model_proposer import ModelProposer

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 30, 31], [3, 4, 5], [60]]   # 3 rows -> bucket of 4


def make(path, env):
    return ModelProposer.from_config(DraftConfig(
        method="model", model=str(path), envelope=env, device="cpu", kernels="reference",
        num_blocks=64, block_size=4))


@pytest.mark.parametrize("name", ["chain4", "tree-small", "tree-wide"])
def test_bucketed_expansion_equals_direct(draft_dir, name):
    env = envelope_from(name)
    direct, bucketed = make(draft_dir, env), make(draft_dir, env)
    bucketed.expander = GraphExpander(bucketed.net, bucketed.cache, bucketed.ops, env,
                                      capture=False)
    trees = []
    for p in (direct, bucketed):
        for s, toks in enumerate(PROMPTS):
            p.update(s, toks, len(toks), [], None)
        trees.append(p.propose(list(range(len(PROMPTS)))))
    (t1, p1), (t2, p2) = trees
    assert torch.equal(t1, t2) and torch.equal(p1, p2)
    assert validate_tree(t1, p1, env.num_nodes, 96) is None
    # 3 rows ran in the 4-bucket; the smaller buckets were made with it, so a batch
    # that shrinks later replays instead of capturing mid-serving
    assert sorted(k[0] for k in bucketed.expander.graphs) == [1, 2, 4]
