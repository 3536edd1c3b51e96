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

import torch


def commit_plan(accepted: torch.Tensor, num_accepted: torch.Tensor,
                kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slot moves that make each accepted path contiguous after its root.

    accepted [B, D] node indices padded with -1; num_accepted [B]; kv_lens [B]
    slots committed before the step. Returns (seq [M], src [M], dst [M]) as
    sequence-local slot positions, only for moves with src != dst.
    """
    b, d = accepted.shape
    i = torch.arange(d, device=accepted.device).expand(b, d)
    base = kv_lens.long().unsqueeze(1) + 1
    src = base + accepted.long()
    dst = base + i
    keep = (i < num_accepted.long().unsqueeze(1)) & (src != dst)
    seq = torch.arange(b, device=accepted.device).unsqueeze(1).expand(b, d)
    return seq[keep], src[keep], dst[keep]
