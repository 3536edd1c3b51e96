"""Target hidden states through a drafter's projection (its `fc`): the verify sends
them so once it has fetched the projection, and a drafter given projected rows drafts
what it drafts from the target's layers (zero rows, the control, do not)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treespec.common.spec.messages import SeqUpdate, SpecRequest
from treespec.common.spec.tree import PRESETS
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.engine import DraftEngine
from test_dflash import _features as features, _proposer as dflash_proposer
from test_dflash import dflash_dir, target4  # noqa: F401  (fixtures)
from test_eagle3 import HIDDEN, _inputs, head_dir  # noqa: F401  (head_dir: a fixture)
from tests_data import tp


def test_eagle3_takes_projected_rows(head_dir):
    """Rows sent through the head's projection (as a verify that fetched it sends
    them) give the trees the target's layers give (the engine projects those in one
    product a request); zero rows do not."""
    env = PRESETS["tree-small"]
    inputs = {s: _inputs(s, 20) for s in (3, 4)}
    trees = []
    for feed in ("raw", "projected", "zeros"):
        eng = DraftEngine(DraftConfig(method="eagle3", envelope=env, model=str(head_dir),
                                      device="cpu", num_blocks=64, block_size=4))
        proj = eng.proposer.projection
        rows = {s: {"raw": r, "projected": F.linear(r, proj),
                    "zeros": torch.zeros(len(t), HIDDEN)}[feed]
                for s, (t, r) in inputs.items()}
        for step, (lo, hi) in enumerate(((0, 14), (14, 21))):
            out = eng.step(SpecRequest(step_id=step + 1, seqs=[
                SeqUpdate(s, committed_len=hi, new_tokens=t[lo:hi], full=lo == 0,
                          hidden=rows[s][lo:hi]) for s, (t, _) in inputs.items()]))
        trees.append(out.trees.tokens.tolist())
    assert trees[0] == trees[1] != trees[2]


def test_dflash_takes_projected_rows(dflash_dir, target4):
    """Rows sent through fc (as a verify that fetched the projection sends them) give
    the block the target's layers give; zero rows do not."""
    toks = torch.randint(0, 95, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    f = features(target4, toks)
    rows = torch.cat([torch.zeros(1, f.shape[1]), f])[:len(toks)]
    blocks = []
    for feed in (lambda p: rows, lambda p: torch.nn.functional.linear(rows, p.projection),
                 lambda p: torch.zeros(len(toks), p.feature_size)):
        prop = dflash_proposer(dflash_dir, target4, "block8")
        prop.update(1, toks[:8], 8, [], feed(prop)[:8])
        prop.update(1, toks, len(toks) - 8, [], feed(prop)[8:])
        blocks.append(tp(prop.propose([1]))[0].tolist())
    assert blocks[0] == blocks[1] != blocks[2]
