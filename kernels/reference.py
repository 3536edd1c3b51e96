"""Pure-torch reference of every kernel: the oracle for tests and the CPU path.

Layout shared by all kernels (the Triton ones in this package take the same):

* KV pages: ``k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]`` for
  one layer. A sequence's slot ``s`` lives at page ``block_table[s // block_size]``,
  offset ``s % block_size``; flat slot id = page * block_size + offset.
* A forward *chunk* per sequence b: ``q_len[b]`` query tokens written at slots
  ``context_len[b] .. context_len[b] + q_len[b] - 1``, right after the
  ``context_len[b]`` slots whose KV is committed. Queries of all sequences are
  concatenated: ``q [total_q, q_heads, head_dim]`` with offsets ``cu_q [B + 1]``.
* The chunk's own structure comes from ``chunk_parents [total_q]``: for each query,
  the chunk-local index of its parent, -1 for none (it sees only the context and
  itself), -2 for padding, -3 (``BLOCK``) for a block query, which sees every
  non-padding query of its chunk (a DFlash block: non-causal). Prefill is a chain
  (parent = i - 1); a tree verify is [root, nodes] with root -1 and node i ->
  parent + 1 (or 0 for the root). A query attends to every context slot and to its
  chunk ancestors and itself.

The attention and the chunk masks, batch-invariant, live in reference_attention.py and
are this module's names too.
"""

from __future__ import annotations

import torch

from treespec.kernels.noise import BONUS_SALT, accept_uniforms, gumbel_noise
from treespec.kernels.reference_attention import (BLOCK, KEY_BLOCK, PAD, ROW_TILE,  # noqa: F401
                                                  TILE_SCORES, _pad_rows, chunk_mask,
                                                  paged_tree_attention)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] at flat slots [T] of one layer's pages."""
    nb, bs = k_cache.shape[:2]
    k_cache.view(nb * bs, *k_cache.shape[2:]).index_copy_(0, slots.long(), k.to(k_cache.dtype))
    v_cache.view(nb * bs, *v_cache.shape[2:]).index_copy_(0, slots.long(), v.to(v_cache.dtype))


def gather_slots(block_table: torch.Tensor, start: int, length: int, block_size: int) -> torch.Tensor:
    """Flat slot ids of a sequence's slots start .. start+length-1: [length] int64."""
    pos = torch.arange(start, start + length, device=block_table.device)
    return block_table.long()[pos // block_size] * block_size + pos % block_size


def tree_ancestors(chunk_parents: torch.Tensor) -> torch.Tensor:
    """Each chunk query's ancestors as bit words: [B, T] parents -> [B * T, W] int64,
    W = ceil(T / 64); bit k of word w is set when chunk key 64 * w + k is a strict,
    non-padding ancestor of the query (padding queries have none). Computed once per
    forward for fixed-shape trees, so attention need not walk parents in every layer."""
    b, t = chunk_parents.shape
    w = -(-t // 64)
    dev = chunk_parents.device
    masks = chunk_mask(chunk_parents) & ~torch.eye(t, dtype=torch.bool, device=dev)  # [B, T, T]
    masks = torch.nn.functional.pad(masks, (0, 64 * w - t)).view(b * t, w, 64).long()
    weights = torch.ones(64, dtype=torch.int64, device=dev) << torch.arange(64, device=dev)
    return (masks * weights).sum(-1)        # distinct bits: the sum is their OR


def accept_greedy(tokens: torch.Tensor, parents: torch.Tensor,
                  target_ids: torch.Tensor, max_depth: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The greedy accept walk over a batch of trees.

    tokens, parents: [B, N] draft tokens and parents (-1 root, -2 padding).
    target_ids: [B, N + 1] the target's choice at [root, node 0 .. node N-1].
    From the root, step to the lowest-index child whose token equals the target's
    choice at the current node; stop when none does.

    Returns accepted [B, max_depth] node indices (root to leaf, padded with -1),
    num_accepted [B] and bonus [B] = the target's choice at the last accepted node.
    """
    b, n = tokens.shape
    dev = tokens.device
    accepted = torch.full((b, max_depth), -1, dtype=torch.int32, device=dev)
    num = torch.zeros(b, dtype=torch.int32, device=dev)
    cur = torch.full((b,), -1, dtype=torch.long, device=dev)    # -1 = the root
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    node_idx = torch.arange(n, device=dev).expand(b, n)
    for d in range(max_depth):
        want = torch.gather(target_ids, 1, (cur + 1).unsqueeze(1))          # [B, 1]
        match = (parents.long() == cur.unsqueeze(1)) & (tokens == want) & alive.unsqueeze(1)
        first = torch.where(match, node_idx, n).min(dim=1).values          # [B]
        found = first < n
        accepted[:, d] = torch.where(found, first, -1).to(torch.int32)
        num += found.to(torch.int32)
        cur = torch.where(found, first, cur)
        alive &= found
    bonus = torch.gather(target_ids, 1, (cur + 1).unsqueeze(1)).squeeze(1)
    return accepted, num, bonus


def rejection_walk(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor,
                   p_ids: torch.Tensor | None, q_ids: torch.Tensor, q_probs: torch.Tensor,
                   seed: torch.Tensor, position: torch.Tensor, max_depth: int, siblings: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rejection-sampling acceptance over trees (SpecInfer / recursive speculative
    decoding). Each node carries the sparse q (ids, probs) it was drawn from, shared
    by its siblings, drawn without replacement in node order. At each node, with p the
    target's distribution there: the next sibling x is accepted with probability
    min(1, p(x) / q(x)); on rejection p <- norm((p - q)+), x leaves q, and the next is
    tried; when none is accepted the bonus is drawn from the p left. Every emitted
    token is then an exact sample of the target, provided q is what each node was
    drawn from and the tree's shape does not depend on the drawn tokens. A node whose
    token has no mass in its q is skipped. Uniforms (accept_uniforms) and the bonus's
    Gumbel noise are keyed by seed and position through their own salts.
    Example: p = [0.5, 0.3, 0.2], siblings 1 then 0 drawn from q = [0.2, 0.8, 0]: 1 is
    accepted w.p. 0.3 / 0.8; else p -> [0.6, 0, 0.4], q -> [1, 0, 0], 0 is accepted
    w.p. 0.6; else the bonus is 2.

    tokens, parents [B, N]; probs [B, T, W] p at [root, node 0 .. N-1] (T = N + 1)
    over the tokens p_ids [B, T, W] (None: W is the vocabulary; the same seeds give
    the same result either way); q_ids, q_probs [B, N, Q]; seed [B]; position [B, T]
    the position drawn at each of [root, nodes]; at most ``siblings`` children tried
    per node. Returns accept_greedy's: accepted [B, max_depth] int32 (-1 padded),
    num_accepted [B] int32, bonus [B] int64."""
    b, n = tokens.shape
    dev = tokens.device
    rows = torch.arange(b, device=dev)
    node_idx = torch.arange(n, device=dev).expand(b, n)
    accepted = torch.full((b, max_depth), -1, dtype=torch.int32, device=dev)
    num = torch.zeros(b, dtype=torch.int32, device=dev)
    bonus = torch.zeros(b, dtype=torch.int64, device=dev)
    cur = torch.full((b,), -1, dtype=torch.long, device=dev)      # -1 = the root
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    for d in range(max_depth + 1):
        r = probs[rows, cur + 1].float().clone()                    # [B, W] what is left of p
        ids = None if p_ids is None else p_ids[rows, cur + 1].long()
        pos = position[rows, cur + 1]

        def column(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """Column of tokens x [B, K] in r and whether it is there."""
            if ids is None:
                return x, torch.ones_like(x, dtype=torch.bool)
            eq = ids.unsqueeze(1) == x.unsqueeze(-1)                        # [B, K, W]
            return eq.int().argmax(-1), eq.any(-1)

        mass = r.sum(-1)
        found = torch.zeros(b, dtype=torch.bool, device=dev)
        nxt = cur.clone()
        if d < max_depth:
            kids = (parents.long() == cur.unsqueeze(1)) & alive.unsqueeze(1)
            rank = kids.long().cumsum(1) - 1
            rejected = torch.full((b, max(1, siblings)), -1, dtype=torch.long, device=dev)
            u = accept_uniforms(seed, pos, max(1, siblings))                  # [B, S]
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
                col, there = column(x.unsqueeze(1))
                px = r.gather(1, col).squeeze(1) * there.squeeze(1) / mass.clamp(min=1e-30)
                ok = has & (qx > 0) & (u[:, j] * qx < px)
                found |= ok
                nxt = torch.where(ok, idx, nxt)
                off = has & ~ok & (qx > 0)          # a node outside its q: skipped
                col, there = column(qi)
                cut = torch.minimum(r.gather(1, col), mass.unsqueeze(1) * qp)
                cut = cut * (off.unsqueeze(1) & there)
                r.scatter_add_(1, col, -cut)
                mass = mass - cut.sum(-1)
                rejected[:, j] = torch.where(off, x, -1)
            accepted[:, d] = torch.where(found, nxt, -1).to(torch.int32)
        stop = alive & ~found
        noise = gumbel_noise(seed ^ BONUS_SALT, pos, r.shape[-1] if ids is None else ids)
        pick = (r.clamp(min=0).log() + noise).argmax(-1)
        pick = pick if ids is None else ids.gather(1, pick.unsqueeze(1)).squeeze(1)
        bonus = torch.where(stop, pick, bonus)
        num += found.to(torch.int32)
        cur = nxt
        alive &= found
    return accepted, num, bonus


def compact_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor,
               dst: torch.Tensor) -> None:
    """Move KV of flat slots src -> dst [M] in every layer.

    Caches [layers, num_blocks, block_size, kv_heads, D]. Accepted-path moves have
    src >= dst and increasing dst, so gathering before scattering is safe.
    """
    if src.numel() == 0:
        return
    for cache in (k_cache, v_cache):
        flat = cache.view(cache.shape[0], -1, *cache.shape[3:])
        flat[:, dst.long()] = flat[:, src.long()]


# ----------------------------------------------------------- per-layer fused ops
# The model calls these through the backend; Triton fuses each into one kernel.

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] normalised over its last dim in fp32, scaled, back in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); residual None means x alone. [T, H]."""
    total = x if residual is None else x + residual
    return rms_norm(total, weight, eps), total


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)           # [T, D/2]
    return freqs.cos(), freqs.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by HF's rotate-half convention; cos, sin [T, D/2]."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def qk_norm_rope_write(qkv: torch.Tensor, q_norm: torch.Tensor | None,
                       k_norm: torch.Tensor | None, positions: torch.Tensor,
                       inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float
                       ) -> torch.Tensor:
    """Split qkv [T, (Hq + 2 Hkv) D]; RMS-norm q and k per head (Qwen3; with no norm
    weights, None, as an EAGLE-3 head: no norm), rotate them, store k and v at slots of
    one layer's pages. Returns q [T, Hq, D]."""
    t = qkv.shape[0]
    d = 2 * inv_freq.shape[0]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k = q.reshape(t, num_heads, d), k.reshape(t, num_kv_heads, d)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    cos, sin = rope_cos_sin(positions, inv_freq)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    write_kv(k_cache, v_cache, k, v.reshape(t, num_kv_heads, d), slots)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x [T, K] @ weight [N, K].T (+ bias [N]) -> [T, N] in x's dtype; a row's bits do
    not depend on T or its place (fp32 rows padded to a multiple of ROW_TILE)."""
    if x.dtype != torch.float32:
        return torch.nn.functional.linear(x, weight, bias)
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], -1)
    return torch.nn.functional.linear(_pad_rows(x, 0), weight, bias)[:x.shape[0]]


def linear_silu_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul(linear(x, gate_up)): x [T, K], gate_up [2I, K] -> [T, I]."""
    return silu_mul(linear(x, gate_up))


def vocab_stats(logits: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [R, V]: its log-sum-exp [R] and the maximum of each whole chunk
    of `chunk` columns [R, V // chunk] (columns past the last whole chunk have none),
    both float32."""
    r, v = logits.shape
    c = v // chunk
    return (logits.float().logsumexp(-1),
            logits[:, :c * chunk].reshape(r, c, chunk).amax(-1).float())
