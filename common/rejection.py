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

Example: p = [0.5, 0.3, 0.2], siblings x1 = 1, x2 = 0 drawn from q = [0.2, 0.8, 0]:
x1 is accepted with probability 0.3 / 0.8; if not, p becomes norm([0.3, 0, 0.2]) =
[0.6, 0, 0.4] and q [1, 0, 0], so x2 = 0 is accepted with probability 0.6, and
otherwise the bonus is drawn from [0, 0, 1]: token 2.
"""

from __future__ import annotations

import torch

from kernels.reference import gumbel_noise, uniform_noise

ACCEPT_SALT = 0x2545F491       # the uniforms of the accept tests
BONUS_SALT = 0x6A09E667        # the bonus draws from what is left of p


def accept_rejection(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor,
                     q_ids: torch.Tensor, q_probs: torch.Tensor, seed: torch.Tensor,
                     position: torch.Tensor, max_depth: int, siblings: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, parents [B, N]; probs [B, T, V] the target's distribution at [root,
    node 0 .. N-1] (T = N + 1); q_ids, q_probs [B, N, Q]; seed [B]; position [B, T]
    the position of the token drawn at each of [root, nodes]; at most ``siblings``
    children per node are tried. Returns what ``kernels.reference.accept_greedy``
    does: accepted [B, max_depth] int32 (padded -1), num_accepted [B] int32, bonus
    [B] int64."""
    b, n = tokens.shape
    dev = tokens.device
    rows = torch.arange(b, device=dev)
    node_idx = torch.arange(n, device=dev).expand(b, n)
    accepted = torch.full((b, max_depth), -1, dtype=torch.int32, device=dev)
    num = torch.zeros(b, dtype=torch.int32, device=dev)
    bonus = torch.zeros(b, dtype=torch.int64, device=dev)
    cur = torch.full((b,), -1, dtype=torch.long, device=dev)      # -1 = the root
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    tried = torch.arange(max(1, siblings), device=dev)
    for d in range(max_depth + 1):
        r = probs[rows, cur + 1].float().clone()                    # [B, V] what is left of p
        mass = r.sum(-1)
        pos = position[rows, cur + 1]
        found = torch.zeros(b, dtype=torch.bool, device=dev)
        nxt = cur.clone()
        if d < max_depth:
            kids = (parents.long() == cur.unsqueeze(1)) & alive.unsqueeze(1)
            rank = kids.long().cumsum(1) - 1
            rejected = torch.full((b, max(1, siblings)), -1, dtype=torch.long, device=dev)
            u = uniform_noise(seed ^ ACCEPT_SALT, pos, tried)                # [B, S]
            for j in range(siblings):
                sel = kids & (rank == j)
                has = sel.any(1) & ~found
                idx = torch.where(sel, node_idx, n).min(1).values.clamp(max=n - 1)
                x = tokens[rows, idx].long()
                qi, qp = q_ids[rows, idx].long(), q_probs[rows, idx].float()      # [B, Q]
                gone = (qi.unsqueeze(-1) == rejected.unsqueeze(1)).any(-1)
                qp = torch.where(gone, 0.0, qp.clamp(min=0))
                qp = qp / qp.sum(-1, keepdim=True).clamp(min=1e-30)
                qx = (qp * (qi == x.unsqueeze(1))).sum(-1)
                px = r[rows, x] / mass.clamp(min=1e-30)
                ok = has & (qx > 0) & (u[:, j] * qx < px)
                found |= ok
                nxt = torch.where(ok, idx, nxt)
                off = has & ~ok & (qx > 0)          # a node outside its q: skipped
                cut = torch.minimum(r.gather(1, qi), mass.unsqueeze(1) * qp) * off.unsqueeze(1)
                r.scatter_add_(1, qi, -cut)
                mass = mass - cut.sum(-1)
                rejected[:, j] = torch.where(off, x, -1)
            accepted[:, d] = torch.where(found, nxt, -1).to(torch.int32)
        stop = alive & ~found
        left = r.clamp(min=0).log() + gumbel_noise(seed ^ BONUS_SALT, pos, r.shape[-1])
        bonus = torch.where(stop, left.argmax(-1), bonus)
        num += found.to(torch.int32)
        cur = nxt
        alive &= found
    return accepted, num, bonus
