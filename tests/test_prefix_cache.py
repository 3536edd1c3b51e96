"""The prefix cache's page bookkeeping (common/runtime/prefix_cache.py) and the paged KV
cache's use of it: keys, sharing, the LRU of unheld pages, eviction, copy before a write."""

from __future__ import annotations

import pytest
import torch

from treespec.common.runtime.block_manager import OutOfPages
from treespec.common.runtime.kv_cache import PagedKVCache, SeqPages
from treespec.common.runtime.prefix_cache import PrefixCache, page_key, root_key

BS = 4


def cache(num_blocks: int = 8, identity: str = "m") -> PagedKVCache:
    return PagedKVCache(1, 1, 2, num_blocks, BS, torch.float32, torch.device("cpu"),
                        prefix=identity)


def computed(c: PagedKVCache, tokens: list[int], slots: int) -> SeqPages:
    """A sequence that wrote the KV of its first `slots` tokens (value = token id)."""
    seq = SeqPages()
    c.take_prefix(seq, c.cached_prefix(seq, tokens), len(tokens))
    c.reserve(seq, slots)
    for pos in range(seq.kv_len, slots):
        p, o = divmod(pos, BS)
        c.k[0, seq.pages[p], o] = tokens[pos]
    seq.kv_len = slots
    c.register(seq, tokens)
    return seq


def test_keys_chain_every_token_before():
    r = root_key("m")
    assert page_key(r, [1, 2, 3, 4]) == page_key(r, [1, 2, 3, 4])
    assert page_key(r, [1, 2, 3, 4]) != page_key(r, [1, 2, 3, 5])
    assert page_key(root_key("other|dtype"), [1, 2, 3, 4]) != page_key(r, [1, 2, 3, 4])
    pc = PrefixCache(4, BS, "m")
    a, b = pc.keys(list(range(8)), 2), pc.keys([9] + list(range(1, 8)), 2)
    assert a[1] != b[1]              # same page-1 tokens, different page 0
    assert pc.keys(list(range(12)), 3, a[:1]) == pc.keys(list(range(12)), 3)


def test_share_the_longest_full_prefix_and_leave_the_last_token():
    c = cache()
    a = computed(c, list(range(10)), 10)          # pages 0, 1 full: registered
    assert c.blocks.num_used == 3 and c.prefix.num_cached == 0
    b = SeqPages()
    got = c.take_prefix(b, c.cached_prefix(b, list(range(8)) + [42, 43]), 10)
    assert got == 8 and b.pages == a.pages[:2] and b.kv_len == 8
    # a prompt of exactly the cached pages reuses all but the page of its last token
    d = SeqPages()
    assert c.take_prefix(d, c.cached_prefix(d, list(range(8))), 8) == 4
    assert (c.prefix.queries, c.prefix.hits) == (10 + 10 + 8, 0 + 8 + 4)
    for s in (a, b, d):
        c.release(s)
    assert c.blocks.num_used == 0 and c.prefix.num_cached == 2 and c.blocks.num_free == 8


def test_unheld_pages_wait_in_lru_and_are_evicted_tail_first():
    c = cache(num_blocks=4)
    a = computed(c, list(range(12)), 12)          # 3 full pages
    pages = list(a.pages)
    c.release(a)
    assert c.blocks.num_used == 0 and c.prefix.num_cached == 3
    (p,) = c.blocks.allocate(1)                   # the one never-used page first
    assert p not in pages and c.prefix.num_cached == 3
    (q,) = c.blocks.allocate(1)                   # then the tail of the released prefix
    assert q == pages[2] and not c.prefix.is_cached(q)
    s = SeqPages()
    assert c.cached_prefix(s, list(range(12)) + [0]) == pages[:2]   # its head still hits
    c.blocks.allocate(2)
    assert c.cached_prefix(SeqPages(), list(range(12)) + [0]) == []
    with pytest.raises(OutOfPages, match="need 1 KV pages, 0 free"):
        c.blocks.allocate(1)


def test_a_page_computed_twice_stays_its_holders_own():
    c = cache()
    a, b = SeqPages(), SeqPages()
    for s in (a, b):            # both looked up before either computed (a race)
        c.take_prefix(s, c.cached_prefix(s, list(range(5))), 5)
    for s in (a, b):
        c.reserve(s, 5)
        s.kv_len = 5
        c.register(s, list(range(5)))
    assert c.prefix.is_cached(a.pages[0]) and not c.prefix.is_cached(b.pages[0])
    c.release(a)
    c.release(b)
    assert c.prefix.num_cached == 1 and c.blocks.num_free == 8


def test_rewind_over_a_cached_page_writes_a_copy():
    c = cache()
    toks = list(range(1, 11))
    a = computed(c, toks, 10)
    b = computed(c, toks[:8] + [50, 51], 10)      # shares pages 0, 1
    shared = list(b.pages[:2])
    c.rewind(b, 6)                                # back into page 1
    assert b.pages[0] == shared[0] and b.pages[1] != shared[1]
    assert c.k[0, b.pages[1], :2, 0, 0].tolist() == [5.0, 6.0]   # its kept slots
    assert b.keys == [c.prefix.keys(toks, 1)[0]] and b.registered == 1
    c.rewind(b, 4)                                # a page boundary: no copy needed
    assert c.k[0, a.pages[1], :, 0, 0].tolist() == [5.0, 6.0, 7.0, 8.0]      # never written
    assert c.cached_prefix(SeqPages(), toks) == a.pages[:2]


def test_rewind_with_no_page_free_drops_from_the_cached_page():
    c = cache(num_blocks=3)
    toks = list(range(1, 9))
    computed(c, toks + [0], 9)                    # holds all 3 pages
    c2 = cache(num_blocks=3)
    a = computed(c2, toks, 8)
    b = SeqPages()
    c2.take_prefix(b, c2.cached_prefix(b, toks + [9]), 9)
    c2.reserve(b, 9)
    b.kv_len = 9
    assert c2.blocks.num_free == 0
    c2.rewind(b, 6)
    assert b.kv_len == 4 and len(b.pages) == 1 and c2.prefix.is_cached(a.pages[1])
