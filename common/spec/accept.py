"""Acceptance of a verified tree, and the KV commit plan that follows it.

Terms used across treespec:

* **draft token**: a token a proposer placed at a tree node.
* **accepted path**: the root-to-node path of draft tokens the target agrees with,
  possibly empty. Node indices, root excluded, padded with -1 to ``depth``.
* **bonus token**: the target's own token at the end of the accepted path; every
  step commits ``len(path) + 1`` tokens, so a step is never worse than decode.
* **committed length**: tokens the verify service has fixed (prompt included). The
  last committed token is the next step's *root*; its KV is not yet written, so
  ``kv_len == committed_len - 1`` between steps.

Worked example (greedy, chain of 3, root r)::

    draft   r → a → b → c        target argmax at [r, a, b, c] = [a, b, x, y]
    accepted path = [0, 1] (a, b); bonus = x; commits a, b, x.

KV commit: the step wrote [root, node 0 .. N-1] at slots kv_len .. kv_len + N.
The root's KV is already in place; accepted node n_i moves from slot
kv_len + 1 + n_i to kv_len + 1 + i, and kv_len advances by 1 + len(path).
"""

from __future__ import annotations

from types import ModuleType

import torch

from treespec.common.runtime.forward_batch import device_slots
from treespec.common.runtime.kv_cache import PagedKVCache


def commit_kv(cache: PagedKVCache, ops: ModuleType, accepted: torch.Tensor,
              num_accepted: torch.Tensor, kv_lens: torch.Tensor,
              block_tables: torch.Tensor) -> None:
    """Move each accepted path's KV into place, at a fixed shape and with no host sync.

    accepted [B, D] node indices padded with -1, num_accepted [B], kv_lens [B]
    committed slots before the step, block_tables [B, P]. Node n_i moves from slot
    kv_len + 1 + n_i to kv_len + 1 + i; entries past num_accepted become moves of a
    slot onto itself (past the new kv_len, never read again), so per sequence dst
    increases strictly with src >= dst and one compaction kernel serves the batch.
    Advancing kv_len is the caller's.
    """
    d = accepted.shape[1]
    i = torch.arange(d, device=accepted.device)
    dst = kv_lens.long().unsqueeze(1) + (i + 1)                        # [B, D]
    src = dst + torch.where(i < num_accepted.unsqueeze(1), accepted - i, 0)
    ops.compact_kv(cache.k, cache.v, device_slots(block_tables, src, cache.block_size).view(-1),
                   device_slots(block_tables, dst, cache.block_size).view(-1))
