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
