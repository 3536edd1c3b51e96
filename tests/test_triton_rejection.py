"""The rejection walk (kernels/triton_rejection.py) against kernels/reference.py on random
trees whose target distribution is sparse (the verify step's top-k candidates), and the
reference's sparse walk against its dense one: the same seeds give the same tokens.
Interpreter on a CPU, compiled with ``TRITON_INTERPRET=0`` on a GPU."""

from __future__ import annotations

import pytest
import torch

from triton_interpret import DEV, HAVE_TRITON, load as _load, needs_triton
from test_triton_kernels import random_tree

from treespec.kernels import reference as ref


def sparse_case(b: int, n: int, v: int, w: int, q: int, seed: int):
    """Trees of n nodes (some padding), a target p over w of v tokens per [root, node]
    (some of them zero, as top-k / top-p leave them), and each node's q over q tokens
    holding its own token most of the time; p also as a dense [B, T, V]."""
    g = torch.Generator().manual_seed(seed)
    t = n + 1
    parents = torch.tensor([random_tree(n, g, pad=i % 3) for i in range(b)], dtype=torch.int32)
    p_ids = torch.rand(b, t, v, generator=g).argsort(-1)[..., :w]
    logits = torch.randn(b, t, w, generator=g) * 2
    logits[..., w // 2:] -= 30 * (torch.rand(b, t, w - w // 2, generator=g) < 0.5)
    probs = logits.softmax(-1)
    q_ids = torch.rand(b, n, v, generator=g).argsort(-1)[..., :q]
    q_probs = torch.rand(b, n, q, generator=g)
    q_probs /= q_probs.sum(-1, keepdim=True)
    pick = torch.randint(0, q + 2, (b, n), generator=g).clamp(max=q - 1)
    tokens = q_ids.gather(-1, pick.unsqueeze(-1)).squeeze(-1)
    off = torch.rand(b, n, generator=g) < 0.1          # now and then a token outside q
    tokens = torch.where(off, torch.randint(0, v, (b, n), generator=g), tokens)
    dense = torch.zeros(b, t, v).scatter(-1, p_ids, probs)
    return (tokens.int(), parents, probs, p_ids, q_ids.int(), q_probs, dense,
            torch.arange(b) * 13 + 5, torch.arange(t).expand(b, t) + 40)


def test_sparse_and_dense_p_give_the_same_walk():
    tokens, parents, probs, p_ids, q_ids, q_probs, dense, seed, pos = sparse_case(
        300, 9, 40, 12, 6, 0)
    for depth, siblings in ((1, 1), (3, 2), (9, 3)):
        got = ref.rejection_walk(tokens, parents, probs, p_ids, q_ids, q_probs, seed, pos,
                                 depth, siblings)
        want = ref.rejection_walk(tokens, parents, dense, None, q_ids, q_probs, seed, pos,
                                  depth, siblings)
        for x, y in zip(got, want):
            assert torch.equal(x, y), (depth, siblings)
        assert got[1].gt(0).any() and got[1].lt(1).any()


@needs_triton
@pytest.mark.parametrize("b, n, w, q, depth, siblings",
                         [(12, 9, 12, 6, 3, 2), (6, 5, 64, 32, 4, 1), (6, 20, 16, 8, 6, 4)])
def test_kernel_vs_reference(b, n, w, q, depth, siblings):
    tr = _load("treespec.kernels.triton_rejection") if HAVE_TRITON else None
    tokens, parents, probs, p_ids, q_ids, q_probs, _, seed, pos = sparse_case(
        b, n, w + 4, w, q, n)
    args = [x.to(DEV) for x in (tokens, parents, probs, p_ids, q_ids, q_probs, seed, pos)]
    tk, pa, pr, pi, qi, qp, sd, ps = args
    got = tr.rejection_walk(tk, pa, pr, pi, qi, qp, sd, ps, depth, siblings)
    want = ref.rejection_walk(tk, pa, pr, pi, qi, qp, sd, ps, depth, siblings)
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert got[1].gt(0).any()
