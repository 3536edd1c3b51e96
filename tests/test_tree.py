"""Envelopes, depths, tree validation and the [root, nodes] chunk layout."""

from __future__ import annotations

import pytest
import torch

from treespec.common.spec.tree import PAD, PRESETS, TreeEnvelope, envelope_from, node_depths, validate_tree, \
    verify_chunk_layout
from treespec.kernels.reference import chunk_mask


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


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 64])
def test_depths_of_the_longest_chain_and_of_random_trees(n):
    # a chain of n nodes is the deepest tree: the rounds must reach its end
    chain = (torch.arange(n, dtype=torch.int32) - 1).unsqueeze(0)
    assert node_depths(chain).tolist() == [list(range(1, n + 1))]
    gen = torch.Generator().manual_seed(n)
    for _ in range(20):
        parents, want = [], []               # a node's parent comes first, never padding
        for i in range(n):
            p = int(torch.randint(-2, i, (1,), generator=gen))
            p = PAD if p >= 0 and parents[p] == PAD else p
            parents.append(p)
            want.append(0 if p == PAD else 1 if p < 0 else want[p] + 1)
        got = node_depths(torch.tensor([parents], dtype=torch.int32))
        assert got.tolist() == [want]


def test_validate_tree_reports_what_is_wrong():
    ok = torch.tensor([[-1, 0]], dtype=torch.int32)
    tok = torch.tensor([[3, 4]], dtype=torch.int32)
    assert validate_tree(tok, ok, 2, 10) is None
    assert "earlier node" in validate_tree(tok, torch.tensor([[-1, 1]], dtype=torch.int32), 2, 10)
    assert "padding" in validate_tree(tok, torch.tensor([[-2, 0]], dtype=torch.int32), 2, 10)
    assert "vocabulary" in validate_tree(torch.tensor([[3, 99]], dtype=torch.int32), ok, 2, 10)
    assert "[B, 3]" in validate_tree(tok, ok, 3, 10)


def reference_verdict(parents: list[list[int]], tokens: list[list[int]], vocab: int) -> str | None:
    """validate_tree's verdict, node by node in plain Python (the test's oracle)."""
    flaws = [False, False, False]      # a bad parent index, a node under padding, a bad token
    for prow, trow in zip(parents, tokens):
        for i, (q, x) in enumerate(zip(prow, trow)):
            if q == PAD:
                continue
            if not -1 <= q < i:
                flaws[0] = True
            elif q >= 0 and prow[q] == PAD:
                flaws[1] = True
            if not 0 <= x < vocab:
                flaws[2] = True
    messages = ("a parent index must be -2, -1 or an earlier node",
                "a node hangs off a padding node",
                f"a draft token is outside the vocabulary [0, {vocab})")
    return next((m for f, m in zip(flaws, messages) if f), None)


@pytest.mark.parametrize("batch", [1, 8])
def test_tree_check_agrees_with_a_node_by_node_check(batch):
    """validate_tree (numpy, one test on the good path) returns the verdict and
    message a node-by-node check does, on every tree, good or broken."""
    import treespec.common.spec.tree as tree
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
        small = reference_verdict(parents.tolist(), tokens.tolist(), vocab)
        large = tree.validate_tree(tokens, parents, n, vocab)
        assert small == large, (parents.tolist(), tokens.tolist())
        seen.add(small)
    assert len(seen) == 4, seen        # good trees and all three kinds of flaw came up
