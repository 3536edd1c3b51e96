"""The ngram proposer: hand-written sequences with exact trees, limits, speed."""

from __future__ import annotations

import random
import time

import torch

from treespec.common.spec.tree import PAD, TreeEnvelope, validate_tree
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.ngram import NgramProposer, merge_paths
from treespec.draft_service.ngram_index import NgramIndex
from tests_data import tp

P = PAD


def propose(tokens: list[int], env: TreeEnvelope, n_min: int = 1, n_max: int = 3
            ) -> tuple[list[int], list[int]]:
    prop = NgramProposer(DraftConfig(method="ngram", envelope=env, ngram_min=n_min,
                                     ngram_max=n_max))
    prop.update(7, tokens, len(tokens), [], None)
    _tb = prop.propose([7])
    t, p = _tb.tokens, _tb.parents
    assert validate_tree(t, p, env.num_nodes, 1000) is None
    return t[0].tolist(), p[0].tolist()


TREE = TreeEnvelope(depth=3, topk=2, num_nodes=6)
CHAIN = TreeEnvelope(depth=3, topk=1, num_nodes=3)


def test_index_example_from_docstring():
    idx = NgramIndex(1, 2)
    idx.extend([5, 6, 7, 5, 6])
    assert list(idx.matches(per_n=8)) == [2]


def brute_matches(toks: list[int], n_min: int, n_max: int, per_n: int) -> list[int]:
    """NgramIndex.matches by its definition: list comparisons at every position."""
    end, seen, out = len(toks), set(), []
    for n in range(min(n_max, end), n_min - 1, -1):
        ends = [e for e in range(end - 1, n - 1, -1)
                if toks[e - n:e] == toks[end - n:] and e not in seen][:per_n]
        seen.update(ends)
        out += ends
    return out


def test_index_matches_equal_a_search_by_definition():
    # token ids whose 4-byte words line up across token boundaries, so the byte
    # search finds straddling occurrences that must not count, and small vocabularies
    # (many matches, per_n cuts them)
    rng = random.Random(3)
    words = [0, 1, 7, 256, 257, 65536, 65792, 1 << 24, 1 << 30]
    straddle = NgramIndex(1, 1)
    straddle.extend([256, 1, 9, 65536])       # 65536's bytes straddle 256 and 1
    assert list(straddle.matches(8)) == []
    for trial in range(400):
        n_min = rng.randint(1, 3)
        n_max, per_n = rng.randint(n_min, 5), rng.randint(1, 6)
        vocab = words if trial % 2 else list(range(rng.randint(1, 8)))
        idx, toks = NgramIndex(n_min, n_max), []
        for _ in range(rng.randint(1, 6)):
            new = [rng.choice(vocab) for _ in range(rng.randint(1, 12))]
            toks += new
            idx.extend(new)
            assert list(idx.matches(per_n)) == brute_matches(toks, n_min, n_max, per_n)


def test_repeated_span_gives_its_continuation():
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3], CHAIN) == ([4, 5, 9], [-1, 0, 1])


def test_two_continuations_become_two_branches_most_recent_first():
    seq = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    assert propose(seq, TREE) == ([5, 7, 1, 4, 9, 1], [-1, 0, 1, -1, 3, 4])


def test_chain_envelope_keeps_one_branch():
    seq = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    assert propose(seq, CHAIN) == ([5, 7, 1], [-1, 0, 1])


def test_longer_suffix_wins_over_more_recent_shorter_one():
    # "8 2 3" recurs once (-> 6); "2 3" alone recurs more recently (-> 4).
    seq = [8, 2, 3, 6, 6, 0, 2, 3, 4, 4, 8, 2, 3]
    toks, pars = propose(seq, TREE)
    assert toks[:3] == [6, 6, 0] and pars[:3] == [-1, 0, 1]
    assert toks[3:5] == [4, 4] and pars[3:5] == [-1, 3]


def test_no_match_is_all_padding():
    assert propose([1, 2, 3, 4, 5], TREE) == ([0] * 6, [P] * 6)
    assert propose([42], CHAIN) == ([0] * 3, [P] * 3)


def test_short_continuation_near_the_end_is_extended_by_older_matches():
    # suffix (7,): most recent earlier 7 is followed by [7] only (the end),
    # the older one by [7, 7]; they share a prefix, so the chain deepens.
    assert propose([7, 7, 7], CHAIN) == ([7, 7, 0], [-1, 0, P])


def test_depth_topk_and_node_limits():
    env = TreeEnvelope(depth=2, topk=2, num_nodes=3)
    # suffix 1 continues as 5 6 | 4 7 | 3 8 (most recent first): topk 2 keeps
    # two roots; depth 2 truncates; N 3 cuts the second branch short.
    seq = [1, 3, 8, 1, 4, 7, 1, 5, 6, 1]
    assert propose(seq, env, n_max=1) == ([5, 6, 4], [-1, 0, -1])


def test_merge_paths_respects_fanout_and_dedups():
    env = TreeEnvelope(depth=2, topk=2, num_nodes=6)
    t, p = merge_paths([[1, 2], [1, 3], [1, 4], [5], [6, 1]], env)
    assert (t, p) == ([1, 2, 3, 5, 0, 0], [-1, 0, 0, -1, P, P])


def test_incremental_updates_equal_a_fresh_index():
    rng = random.Random(0)
    env = TreeEnvelope(depth=4, topk=2, num_nodes=8)
    cfg = DraftConfig(method="ngram", envelope=env, ngram_min=1, ngram_max=4)
    inc = NgramProposer(cfg)
    seq: list[int] = [rng.randrange(6) for _ in range(5)]
    inc.update(1, seq, len(seq), [], None)
    for _ in range(40):
        new = [rng.randrange(6) for _ in range(rng.randint(1, 3))]
        seq.extend(new)
        inc.update(1, seq, len(new), [], None)
        fresh = NgramProposer(cfg)
        fresh.update(1, list(seq), len(seq), [], None)
        a, b = tp(inc.propose([1])), tp(fresh.propose([1]))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert validate_tree(*a, 8, 6) is None
    # a stale index (lengths disagree) is rebuilt, not trusted
    inc.update(1, seq + [1, 2], 1, [], None)
    assert len(inc._index[1]) == len(seq) + 2


def test_batch_rows_in_order_and_release():
    env = TreeEnvelope(depth=2, topk=1, num_nodes=2)
    prop = NgramProposer(DraftConfig(method="ngram", envelope=env))
    prop.update(1, [4, 5, 4], 3, [], None)
    prop.update(2, [1, 2, 3], 3, [], None)
    _tb = prop.propose([2, 1])
    t, p = _tb.tokens, _tb.parents
    assert t.tolist() == [[0, 0], [5, 4]] and p.tolist() == [[P, P], [-1, 0]]
    assert t.dtype == p.dtype == torch.int32
    prop.release(1)
    prop.release(1)
    assert 1 not in prop._index


def test_a_few_thousand_tokens_stay_fast():
    rng = random.Random(1)
    env = TreeEnvelope(depth=5, topk=4, num_nodes=32)
    prop = NgramProposer(DraftConfig(method="ngram", envelope=env, ngram_max=4))
    base = [rng.randrange(50) for _ in range(200)]
    seq = base * 20                                   # 4000 tokens, lots of repeats
    start = time.perf_counter()
    prop.update(1, seq, len(seq), [], None)
    for i in range(200):
        seq.append(base[i % len(base)])
        prop.update(1, seq, 1, [], None)
        _tb = prop.propose([1])
        t, p = _tb.tokens, _tb.parents
    elapsed = time.perf_counter() - start
    assert validate_tree(t, p, 32, 50) is None
    assert int((p[0] != P).sum()) >= 5
    assert elapsed < 2.0, f"200 steps over 4k tokens took {elapsed:.2f}s"
