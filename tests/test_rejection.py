"""Rejection-sampling acceptance (treespec.kernels.reference.rejection_walk) on hand-built trees.

Each batch row is one trial with its own seed: its drafts are drawn from q (siblings
without replacement) by a generator of the test's, so over many rows the emitted
tokens must follow the target's distribution exactly, and a fixed tree's outcomes
must have the probabilities the recursion gives by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from treespec.kernels import reference
from treespec.common.spec.tree import PAD

ROWS = 40_000


def chi_square_p(counts: torch.Tensor, p: torch.Tensor) -> float:
    exp = p.double() * counts.sum()
    live = exp > 0
    assert counts[~live].sum() == 0, "a token the target never draws"
    stat = ((counts[live].double() - exp[live]) ** 2 / exp[live]).sum()
    dof = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def test_a_fixed_tree_has_the_recursions_probabilities():
    """p = [0.5, 0.3, 0.2], siblings 1 then 0 drawn from q = [0.2, 0.8, 0]: accept 1
    with 0.3 / 0.8; else p -> [0.6, 0, 0.4], q -> [1, 0, 0], accept 0 with 0.6; else
    the bonus is 2."""
    b = ROWS
    tokens = torch.tensor([[1, 0]]).expand(b, 2)
    parents = torch.tensor([[-1, -1]]).expand(b, 2)
    probs = torch.tensor([0.5, 0.3, 0.2]).expand(b, 3, 3)
    q_ids = torch.arange(3).expand(b, 2, 3)
    q_probs = torch.tensor([0.2, 0.8, 0.0]).expand(b, 2, 3)
    acc, num, bonus = reference.rejection_walk(tokens, parents, probs, None, q_ids, q_probs,
                                       torch.arange(b), torch.full((b, 3), 7), 1, 2)
    first = (acc[:, 0] == 0).double().mean()
    second = (acc[:, 0] == 1).double().mean()
    tol = 4 * math.sqrt(0.25 / b)
    assert abs(first - 0.375) < tol and abs(second - 0.625 * 0.6) < tol
    assert bonus[num == 0].eq(2).all() and acc[:, 0].ne(-1).eq(num.bool()).all()


def _markov_trial(v: int = 6, q_width: int = 4, seed: int = 0):
    """A target whose next-token distribution depends on the last token (P [V, V]),
    a drafter q that is P sharpened and cut to q_width tokens, and a tree-small-like
    tree per row: two root children drawn without replacement from q(root), the first
    of them with two children drawn from q(its token)."""
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn(v, v, generator=g) * 1.5, -1)
    Q = torch.softmax(torch.randn(v, v, generator=g) * 0.5 + P.log() * 1.5, -1)
    top, at = Q.topk(q_width, -1)
    top = top / top.sum(-1, keepdim=True)
    root = 3
    b = ROWS

    def two(row_of: torch.Tensor) -> torch.Tensor:      # without replacement, [B, 2]
        w = torch.zeros(b, v).scatter(1, at[row_of], top[row_of])
        return torch.multinomial(w, 2, replacement=False, generator=g)

    lvl1 = two(torch.full((b,), root))
    lvl2 = two(lvl1[:, 0])
    tokens = torch.cat([lvl1, lvl2], 1)                                  # nodes 0..3
    parents = torch.tensor([[-1, -1, 0, 0]]).expand(b, 4)
    prev = torch.cat([torch.full((b, 1), root), tokens], 1)              # [B, T]
    probs = P[prev]                                                      # [B, T, V]
    owner = torch.stack([torch.full((b,), root), torch.full((b,), root), lvl1[:, 0],
                         lvl1[:, 0]], 1)                                 # q row per node
    return P, root, tokens, parents, probs, at[owner], top[owner]


def _emitted(tokens, acc, num, bonus) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """first token, second token (valid where deep) and the deep mask."""
    rows = torch.arange(tokens.shape[0])
    first = torch.where(num > 0, tokens[rows, acc[:, 0].clamp(min=0).long()], bonus)
    second = torch.where(num > 1, tokens[rows, acc[:, 1].clamp(min=0).long()], bonus)
    return first, second, num > 0


@pytest.mark.parametrize("control", [False, True])
def test_emitted_tokens_follow_the_target_and_the_check_matters(control, monkeypatch):
    if control:     # accept whatever has target mass: min(1, p / q) never checked
        monkeypatch.setattr(reference, "accept_uniforms",
                            lambda seed, position, siblings: torch.zeros(seed.shape[0], siblings))
    P, root, tokens, parents, probs, q_ids, q_probs = _markov_trial()
    b = tokens.shape[0]
    pos = torch.arange(5).expand(b, 5) + 100
    acc, num, bonus = reference.rejection_walk(tokens, parents, probs, None, q_ids, q_probs,
                                       torch.arange(b) * 7 + 1, pos, 2, 2)
    first, second, deep = _emitted(tokens, acc, num, bonus)
    pvals = [chi_square_p(torch.bincount(first, minlength=P.shape[0]), P[root])]
    for x in first[deep].unique():          # the next token, given an accepted first one
        given = deep & (first == x)
        if given.sum() >= 500:
            pvals.append(chi_square_p(torch.bincount(second[given], minlength=P.shape[0]),
                                      P[x]))
    assert len(pvals) >= 2 and (num == 2).any()
    if control:
        assert min(pvals) < 1e-6
    else:
        assert min(pvals) * len(pvals) > 1e-3, pvals      # Bonferroni


def test_a_node_outside_its_q_is_never_accepted_and_padding_is_ignored():
    b = 2000
    tokens = torch.tensor([[2, 0, 0]]).expand(b, 3)
    parents = torch.tensor([[-1, PAD, PAD]]).expand(b, 3)
    probs = torch.tensor([0.1, 0.1, 0.8]).expand(b, 4, 3)
    q_ids = torch.tensor([0, 1, 0]).expand(b, 3, 3)            # token 2 has no q mass
    q_probs = torch.tensor([0.5, 0.5, 0.0]).expand(b, 3, 3)
    acc, num, bonus = reference.rejection_walk(tokens, parents, probs, None, q_ids, q_probs,
                                       torch.arange(b), torch.zeros(b, 4, dtype=torch.long),
                                       2, 1)
    assert num.eq(0).all()
    counts = torch.bincount(bonus, minlength=3)
    assert chi_square_p(counts, torch.tensor([0.1, 0.1, 0.8])) > 1e-3


def test_a_sampling_rows_tree_shape_does_not_depend_on_what_it_drew():
    """Rejection sampling is exact only if the kept siblings are not chosen by their
    own tokens: treespec.draft_service.tree_build scores a static row's children by rank."""
    from treespec.draft_service.tree_build import Expansion
    k, depth, v = 2, 4, 50
    shapes = []
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        lp = lambda *shape: torch.randn(*shape, v, generator=g).log_softmax(-1)  # noqa: E731
        static = torch.tensor([True, False])
        root = lp(2)
        exp = Expansion(root, k, depth, root + torch.rand(2, v, generator=g), static=static)
        for level in range(1, depth):
            nxt = lp(2, k)
            exp.grow(level, nxt, nxt + torch.rand(2, k, v, generator=g))
        shapes.append(exp.rerank(8)[1])
    assert all(torch.equal(s[0], shapes[0][0]) for s in shapes)          # static: one shape
    assert shapes[0][0].tolist() == [-1, 0, 1, 2, -1, 0, 4, 1]           # chain + siblings
    assert any(not torch.equal(s[1], shapes[0][1]) for s in shapes)      # greedy: varies
