from __future__ import annotations

import pytest

from treespec.common.runtime.block_manager import BlockManager, OutOfPages


def test_allocate_share_free_round_trip():
    bm = BlockManager(4, 16)
    a = bm.allocate(3)
    assert bm.num_free == 1 and len(set(a)) == 3
    bm.share(a[:1])
    bm.free(a)
    assert bm.num_free == 3          # the shared page is still held once
    bm.free(a[:1])
    assert bm.num_free == 4
    with pytest.raises(ValueError, match="freed twice"):
        bm.free(a[:1])


def test_out_of_pages_is_clear():
    bm = BlockManager(2, 16)
    with pytest.raises(OutOfPages, match="need 3 KV pages, 2 free"):
        bm.allocate(3)
    assert bm.blocks_for(33) == 3
