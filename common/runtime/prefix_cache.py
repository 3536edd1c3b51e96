"""Prefix caching: full KV pages shared by the hash of their tokens and all before them.

A page is *full* once all ``block_size`` of its slots hold committed KV; from then on
its contents never change (a step writes only past a sequence's ``kv_len``). Its *key*
is a hash chain over the tokens::

    key(-1) = H(identity)                       # model, dtype, page size
    key(i)  = H(key(i - 1), tokens[i * bs : (i + 1) * bs])

so a key names the page's tokens and everything before them: two sequences whose first
``k`` pages have equal keys have equal KV there. ``PrefixCache`` is a ``BlockManager``
that remembers which page holds the KV of which key; a new sequence takes the pages of
its longest cached prefix (one more reference each) instead of computing them.

Pages keep the BlockManager's reference counts. A cached page whose count falls to 0 is
not freed: it waits, still cached, in an LRU until an allocation finds no free page and
takes the page released longest ago (forgetting its key). Counts:

    num_used     pages some sequence holds
    num_cached   pages held by no one, still cached (an allocation may take them)
    num_free     pages an allocation can get: never used or forgotten, plus num_cached

Example, block_size 4: sequence A computes tokens [1 .. 10]; its pages 0 ([1 2 3 4]) and
1 ([5 6 7 8]) are full and get registered. B arrives with [1 .. 8, 42, 43]: ``lookup`` of
its keys finds both pages, B holds them and computes only [42, 43] (into a page of its
own). A ends: page 0 and 1 stay held by B; when B ends too they wait in the LRU.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from treespec.common.runtime.block_manager import BlockManager, OutOfPages


def root_key(identity: str) -> bytes:
    """key(-1): what the KV depends on besides the tokens (model, dtype, page size)."""
    return hashlib.blake2b(identity.encode(), digest_size=16).digest()


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full page holding ``tokens`` after the page keyed ``parent``."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PrefixCache(BlockManager):
    """A BlockManager whose full pages may be registered under a key and shared."""

    def __init__(self, num_blocks: int, block_size: int, identity: str) -> None:
        super().__init__(num_blocks, block_size)
        self.root = root_key(f"{identity}|block_size={block_size}")
        self._page_of: dict[bytes, int] = {}      # key -> the page holding its KV
        self._key_of: dict[int, bytes] = {}       # and back
        self._lru: OrderedDict[int, None] = OrderedDict()   # cached pages no one holds
        self.queries = 0        # prompt tokens looked up (tokens, as vLLM counts them)
        self.hits = 0           # of those, tokens whose KV was found

    # ------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    # ------------------------------------------------------------ keys
    def keys(self, tokens: Sequence[int], num_pages: int, known: Sequence[bytes] = ()
             ) -> list[bytes]:
        """Keys of tokens' first num_pages full pages; known: keys of its first pages
        already computed (extended, not recomputed)."""
        bs = self.block_size
        out = list(known[:num_pages])
        parent = out[-1] if out else self.root
        for i in range(len(out), num_pages):
            parent = page_key(parent, tokens[i * bs:(i + 1) * bs])
            out.append(parent)
        return out

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached prefix of keys (no reference taken)."""
        pages: list[int] = []
        for k in keys:
            p = self._page_of.get(k)
            if p is None:
                break
            pages.append(p)
        return pages

    def unheld(self, pages: Sequence[int]) -> int:
        """How many of these cached pages no one holds (taking them lowers num_free)."""
        return sum(p in self._lru for p in pages)

    def hold(self, pages: Sequence[int]) -> None:
        """Take a reference on each of these cached pages (from the LRU if unheld)."""
        for p in pages:
            if self._refs[p] == 0:
                del self._lru[p]
            self._refs[p] += 1

    def register(self, page: int, key: bytes) -> bool:
        """page (held, full) now holds key's KV; False when another page already does
        (page then stays its holder's own, freed as any page)."""
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} is not allocated")
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    # ------------------------------------------------------------ BlockManager's API
    def allocate(self, n: int) -> list[int]:
        """n pages: free ones first, then the cached pages released longest ago."""
        if n > self.num_free:
            raise OutOfPages(f"need {n} KV pages, {self.num_free} free "
                             f"({len(self._lru)} of them cached)")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._lru.popitem(last=False)
                del self._page_of[self._key_of.pop(b)]
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop a reference on each page; a cached page no one holds joins the LRU
        (the last page of a sequence first, so a prefix's tail is evicted before its
        head, which more sequences share)."""
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise ValueError(f"page {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._key_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)
