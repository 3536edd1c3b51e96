"""Envelopes, depths, tree validation and the [root, nodes] chunk layout."""

from __future__ import annotations

import pytest
import torch

from common.tree import PRESETS, TreeEnvelope, envelope_from, node_depths, validate_tree, \
    verify_chunk_layout
from kernels.reference import chunk_mask


def test_presets_are_valid_and_chain_is_topk1():
    assert PRESETS["chain4"].topk == 1 and PRESETS["chain4"].num_nodes == 4
    for e in PRESETS.values():
        assert e.num_nodes <= e.max_nodes


@pytest.mark.parametrize("args", [dict(depth=0, topk=1, num_nodes=1),
                                  dict(depth=3, topk=1, num_nodes=4),
                                  dict(depth=2, topk=2, num_nodes=7),
                                  dict(depth=9, topk=8, num_nodes=65)])
def test_bad_envelopes_are_refused(args):
    with pytest.raises(ValueError):
        TreeEnvelope(**args)


def test_envelope_from_names_and_numbers():
    assert envelope_from("tree-small") is PRESETS["tree-small"]
    assert envelope_from(depth=3, topk=2, num_nodes=5).num_nodes == 5
    with pytest.raises(ValueError, match="unknown envelope"):
        envelope_from("bushy")
    with pytest.raises(ValueError):
        envelope_from(depth=3)


def test_depths_and_chunk_layout():
    parents = torch.tensor([[-1, -1, 0, 2, -2]], dtype=torch.int32)
    assert node_depths(parents).tolist() == [[1, 1, 2, 3, 0]]
    cp, d = verify_chunk_layout(parents)
    assert cp.tolist() == [[-1, 0, 0, 1, 3, -2]]
    assert d.tolist() == [[0, 1, 1, 2, 3, 0]]
    m = chunk_mask(cp[0])
    assert m[4].tolist() == [True, True, False, True, True, False]   # node 3: root, 0, 2, self
    assert m[5].tolist() == [False] * 5 + [True]                     # padding sees itself


def test_validate_tree_reports_what_is_wrong():
    ok = torch.tensor([[-1, 0]], dtype=torch.int32)
    tok = torch.tensor([[3, 4]], dtype=torch.int32)
    assert validate_tree(tok, ok, 2, 10) is None
    assert "earlier node" in validate_tree(tok, torch.tensor([[-1, 1]], dtype=torch.int32), 2, 10)
    assert "padding" in validate_tree(tok, torch.tensor([[-2, 0]], dtype=torch.int32), 2, 10)
    assert "vocabulary" in validate_tree(torch.tensor([[3, 99]], dtype=torch.int32), ok, 2, 10)
    assert "[B, 3]" in validate_tree(tok, ok, 3, 10)


@pytest.mark.parametrize("batch", [1, 8])
def test_small_and_large_tree_checks_agree(batch, monkeypatch):
    """validate_tree checks small batches in Python and large ones with numpy: the
    two must return the same verdict and message on every tree, good or broken."""
    import common.tree as tree
    g = torch.Generator().manual_seed(batch)
    n, vocab = 8, 50

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=g))

    seen: set[str | None] = set()
    for _ in range(400):
        # a random tree in topological order, then up to two random corruptions
        parents = torch.tensor([[-1] + [rand(-1, i) for i in range(1, n)]
                                for _ in range(batch)], dtype=torch.int32)
        tokens = torch.randint(0, vocab, (batch, n), generator=g, dtype=torch.int32)
        for _ in range(rand(0, 3)):
            r, c, what = rand(0, batch), rand(0, n), rand(0, 4)
            if what == 0:
                parents[r, c] = rand(-3, n + 1)
            elif what == 1:
                tokens[r, c] = (-1, vocab, vocab + 7)[rand(0, 3)]
            elif what == 2:
                parents[r, c:] = tree.PAD          # a padded tail: fine
            else:
                parents[r, c] = tree.PAD           # its children now hang off padding
        monkeypatch.setattr(tree, "SMALL_TREE_NODES", 10**9)
        small = tree.validate_tree(tokens, parents, n, vocab)
        monkeypatch.setattr(tree, "SMALL_TREE_NODES", -1)
        large = tree.validate_tree(tokens, parents, n, vocab)
        assert small == large, (parents.tolist(), tokens.tolist())
        seen.add(small)
    assert len(seen) == 4, seen        # good trees and all three kinds of flaw came up
