"""Hand-built trees with forced target choices give exact accepted paths and KV moves."""

from __future__ import annotations

import torch

from types import SimpleNamespace

from treespec.common.spec.accept import commit_kv
from treespec.kernels import reference as ref


def t(x):
    return torch.tensor(x, dtype=torch.int32)


def walk(tokens, parents, target, depth):
    acc, num, bonus = ref.accept_greedy(t(tokens), t(parents), t(target), depth)
    return acc.tolist(), num.tolist(), bonus.tolist()


def test_chain_docstring_example():
    # root r -> a(10) -> b(11) -> c(12); target at [r, a, b, c] = [10, 11, 99, 5]
    acc, num, bonus = walk([[10, 11, 12]], [[-1, 0, 1]], [[10, 11, 99, 5]], 3)
    assert acc == [[0, 1, -1]] and num == [2] and bonus == [99]


def test_chain_all_and_none_accepted():
    acc, num, bonus = walk([[10, 11, 12], [10, 11, 12]], [[-1, 0, 1]] * 2,
                           [[10, 11, 12, 7], [3, 11, 12, 7]], 3)
    assert acc == [[0, 1, 2], [-1, -1, -1]] and num == [3, 0] and bonus == [7, 3]


def test_two_by_two_tree_takes_the_matching_branch():
    # root -> a(0)=5, b(1)=6; a -> c(2)=7, d(3)=8; b -> e(4)=9, f(5)=7
    tokens = [[5, 6, 7, 8, 9, 7]]
    parents = [[-1, -1, 0, 0, 1, 1]]
    # target picks 6 at root, 7 at b (node 1 -> query 2), 42 at f (node 5 -> query 6)
    target = [[6, 0, 7, 0, 0, 0, 42]]
    acc, num, bonus = walk(tokens, parents, target, 2)
    assert acc == [[1, 5]] and num == [2] and bonus == [42]


def test_padding_is_never_accepted_and_duplicates_take_lowest_index():
    tokens = [[4, 4, 4]]
    parents = [[-2, -1, -1]]          # node 0 is padding though its token matches
    acc, num, bonus = walk(tokens, parents, [[4, 1, 2, 3]], 1)
    assert acc == [[1]] and num == [1] and bonus == [2]


def test_commit_kv_moves_each_accepted_path_after_its_root():
    """Sequence-local slot s of row b lives at table[b][s // 4] * 4 + s % 4; each KV
    value is its own flat slot, so what moved where reads off the cache."""
    accepted = t([[1, 5], [0, 1], [-1, -1]])
    num = t([2, 2, 0])
    kv_lens = t([10, 3, 7])
    tables = t([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
    k = torch.arange(15 * 4, dtype=torch.float32).view(1, 15, 4, 1, 1)
    cache = SimpleNamespace(k=k, v=-k, block_size=4)
    commit_kv(cache, ref, accepted, num, kv_lens, tables)
    got = cache.k.view(3, 20)                        # [row, sequence-local slot]
    before = torch.arange(60, dtype=torch.float32).view(3, 20)
    # seq 0: node 1 at slot 12 -> 11, node 5 at 16 -> 12; seq 1 already contiguous
    want = before.clone()
    want[0, 11], want[0, 12] = before[0, 12], before[0, 16]
    assert torch.equal(got, want) and torch.equal(cache.v, -cache.k)


def test_compact_kv_makes_the_path_contiguous():
    k = torch.arange(2 * 4 * 2 * 1 * 1, dtype=torch.float32).view(2, 4, 2, 1, 1)
    v = -k.clone()
    before = k.clone()
    ref.compact_kv(k, v, torch.tensor([5, 7]), torch.tensor([4, 5]))
    flat, old = k.view(2, 8), before.view(2, 8)
    assert torch.equal(flat[:, 4], old[:, 5]) and torch.equal(flat[:, 5], old[:, 7])
    assert torch.equal(v.view(2, 8)[:, 4], -old[:, 5])
