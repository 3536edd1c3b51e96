"""Rejection-sampling acceptance over trees (SpecInfer / recursive speculative
decoding), at fixed shapes on the device.

A drafter that samples sends, with each node, the distribution q it was drawn from:
a sparse row (ids [Q], probs [Q]) shared by siblings, which are drawn from it without
replacement, in node-index order. From the root, at each node with target
distribution p (the request's filtered distribution there):

* the next sibling x (q already stripped of the siblings rejected before it and
  renormalized) is accepted with probability min(1, p(x) / q(x));
* on rejection p <- norm((p - q)+) and q <- q without x, renormalized; then the next;
* when every sibling is rejected, or the node has none, the bonus token is drawn
  from the p left.

Each emitted token is then an exact sample of the target's distribution, whatever q
is, provided q is what the node was really drawn from and the tree's shape does not
depend on the drawn tokens (draft_service.tree_build keeps it static for such
rows). A node whose token has no mass in its q was not drawn from it: it is skipped,
never accepted and p is left as it was. The uniforms and
the bonus draw come from the request's seed through their own salts, independent of
the noise the drafter drew with (kernels.reference.uniform_noise).

The walk itself is a kernel (``rejection_walk``, kernels/reference.py and, when the
target's distribution is sparse, one Triton program per row); this module keys its
random numbers.

Example: p = [0.5, 0.3, 0.2], siblings x1 = 1, x2 = 0 drawn from q = [0.2, 0.8, 0]:
x1 is accepted with probability 0.3 / 0.8; if not, p becomes norm([0.3, 0, 0.2]) =
[0.6, 0, 0.4] and q [1, 0, 0], so x2 = 0 is accepted with probability 0.6, and
otherwise the bonus is drawn from [0, 0, 1]: token 2.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels import reference
from kernels.reference import gumbel_noise, uniform_noise

ACCEPT_SALT = 0x2545F491       # the uniforms of the accept tests
BONUS_SALT = 0x6A09E667        # the bonus draws from what is left of p


def accept_rejection(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor,
                     q_ids: torch.Tensor, q_probs: torch.Tensor, seed: torch.Tensor,
                     position: torch.Tensor, max_depth: int, siblings: int,
                     p_ids: torch.Tensor | None = None, ops: ModuleType = reference
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, parents [B, N]; probs [B, T, W] the target's distribution at [root,
    node 0 .. N-1] (T = N + 1) over the tokens p_ids [B, T, W] (None: the whole
    vocabulary, W = V); q_ids, q_probs [B, N, Q]; seed [B]; position [B, T] the
    position of the token drawn at each of [root, nodes]; at most ``siblings``
    children per node are tried. Returns what ``kernels.reference.accept_greedy``
    does: accepted [B, max_depth] int32 (padded -1), num_accepted [B] int32, bonus
    [B] int64. The same seeds give the same result whether p is dense or sparse."""
    b, t = position.shape
    key = seed.repeat_interleave(t)
    pos = position.reshape(-1)
    tried = torch.arange(max(1, siblings), device=tokens.device)
    u = uniform_noise(key ^ ACCEPT_SALT, pos, tried).view(b, t, -1)[..., :siblings]
    ids = probs.shape[-1] if p_ids is None else p_ids.reshape(b * t, -1)
    g = gumbel_noise(key ^ BONUS_SALT, pos, ids).view(b, t, -1)
    return ops.rejection_walk(tokens, parents, probs, p_ids, q_ids, q_probs, u.contiguous(),
                              g, max_depth)
