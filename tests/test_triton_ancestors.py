"""The tree-ancestor words (kernels/triton_ancestors.py) against kernels/reference.py,
and tree attention given them against attention that walks parents (and the reference),
for equal-length trees as a fixed-shape verify step has them. Interpreter on a CPU,
compiled with ``TRITON_INTERPRET=0`` on a GPU (see test_triton_kernels)."""

from __future__ import annotations

import functools

import pytest
import torch

from treespec.kernels import reference as ref
from test_triton_kernels import as_chunk, build_batch, i32, paged, random_tree
from triton_interpret import DEV, HAVE_TRITON, load as _load, needs_triton

pytestmark = needs_triton

if HAVE_TRITON:
    _load("treespec.kernels.triton_common")
    anc_mod = _load("treespec.kernels.triton_ancestors")
    attn_mod = _load("treespec.kernels.triton_tree_attention")


def _equal_trees(b: int, t: int, g: torch.Generator) -> torch.Tensor:
    """[B, T] chunk parents of equal-length trees, one all padding past its root."""
    rows = [as_chunk(random_tree(t - 1, g, pad=(t - 1) // 3 if i % 2 else 0)) for i in range(b)]
    rows[-1] = [-1] + [-2] * (t - 1)
    return i32(rows)


@pytest.mark.parametrize("b, t", [(3, 9), (2, 70)])
def test_tree_ancestors_vs_reference(b, t):
    par = _equal_trees(b, t, torch.Generator().manual_seed(t))
    got = anc_mod.tree_ancestors(par)
    want = ref.tree_ancestors(par)
    assert got.shape == (b * t, -(-t // 64)) and torch.equal(got, want)
    # bit k of word w: key 64w + k is a strict ancestor (the reference's own mask)
    mask = ref.chunk_mask(par[0]) & ~torch.eye(t, dtype=torch.bool, device=DEV)
    bits = torch.stack([(want[:t, j // 64] >> (j % 64)) & 1 for j in range(t)], 1).bool()
    assert torch.equal(bits, mask)


@functools.cache
def _equal_length_case() -> tuple:
    """Equal-length trees (as a fixed-shape verify step has) in a paged batch, and
    attention over them walking parents (tiles of 16 keys): one interpreted walk serves
    both tilings below."""
    g = torch.Generator().manual_seed(11)
    b, t = 2, 70
    par2 = _equal_trees(b, t, g)
    nb, table, ctx, cu, par = build_batch(par2.tolist(), [5, 9], 4, 1, g)
    kc, vc = paged(nb, 4, 1, 16)
    q = torch.randn(int(cu[-1]), 2, 16, generator=g).to(DEV)
    args = (q, kc, vc, table, ctx, cu, par, 0.3)
    walked = attn_mod.paged_tree_attention(*args, block_m=32, block_n=16, num_splits=2)
    return par2, args, walked


@pytest.mark.parametrize("block_n", [16, 64])
def test_attention_with_precomputed_ancestors(block_n):
    """The ancestor words given: the same result as walking parents, and as the
    reference."""
    par2, args, walked = _equal_length_case()
    anc = anc_mod.tree_ancestors(par2)
    out = attn_mod.paged_tree_attention(*args, anc, block_m=32, block_n=block_n, num_splits=2)
    want = ref.paged_tree_attention(*args, anc)
    torch.testing.assert_close(out, walked, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def _blocks(b: int, t: int) -> torch.Tensor:
    """[B, T] chunk parents of DFlash blocks (every query BLOCK), one with a padded tail."""
    rows = [[ref.BLOCK] * t for _ in range(b)]
    rows[-1][t - 2:] = [-2, -2]
    return i32(rows)


@pytest.mark.parametrize("b, t", [(3, 9), (2, 70)])
def test_block_queries_see_their_whole_block(b, t):
    """BLOCK rows (a DFlash block, non-causal): the ancestor words hold every other
    non-padding query, Triton's attention (words given or not) equals the
    reference's, and that is softmax attention over the context and the whole block."""
    g = torch.Generator().manual_seed(5)
    par2 = _blocks(b, t)
    got = anc_mod.tree_ancestors(par2)
    assert torch.equal(got, ref.tree_ancestors(par2))
    nb, table, ctx, cu, par = build_batch(par2.tolist(), [5, 0, 3][:b], 4, 1, g)
    kc, vc = paged(nb, 4, 1, 16)
    q = torch.randn(int(cu[-1]), 2, 16, generator=g).to(DEV)
    want = ref.paged_tree_attention(q, kc, vc, table, ctx, cu, par, 0.3)
    for anc in (got, None) if t < 64 else (got,):        # walking parents: the short case
        out = attn_mod.paged_tree_attention(q, kc, vc, table, ctx, cu, par, 0.3, anc,
                                            block_m=32, block_n=16, num_splits=2)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    s = 0                      # the first chunk by hand: every key of context and block
    n = int(ctx[s]) + t
    slots = [int(table[s, j // 4]) * 4 + j % 4 for j in range(n)]
    k, v = kc.view(-1, 1, 16)[slots, 0], vc.view(-1, 1, 16)[slots, 0]
    for i in range(t):
        for h in range(2):
            w = torch.softmax(q[i, h] @ k.T * 0.3, -1)
            torch.testing.assert_close(want[i, h], w @ v, atol=1e-5, rtol=1e-5)
