"""The CPU reference's tree attention, batch-invariant: a query row's bits depend on its
query and the keys it sees, not on the rows beside it in the forward, nor on its
chunk's shape (a decode row and a tree node at the same position agree bit for bit).
Layout and semantics: treespec.kernels.reference's docstring; its paged_tree_attention
is this one.
"""

from __future__ import annotations

import torch

PAD = -2            # a chunk parent (and a tree node's parent): padding, seen by no query
BLOCK = -3          # a chunk parent: the query sees its whole chunk (padding aside)


def chunk_mask(chunk_parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self mask of chunks: [..., T] parents -> [..., T, T] bool.

    mask[i, j] is True when j is i or an ancestor of i. Padding rows see only
    themselves (so softmax stays finite) and nobody sees padding; a BLOCK row sees
    every row. A chain (prefill) is the causal mask; a tree walks every node's
    ancestors up, one level a round.
    """
    *lead, t = chunk_parents.shape
    dev = chunk_parents.device
    parent = chunk_parents.reshape(-1, t).long()                            # [C, T]
    rows = torch.arange(t, device=dev)
    if bool((parent == rows - 1).all()):
        return (rows.unsqueeze(1) >= rows).expand(*lead, t, t).clone()
    eye = torch.eye(t, dtype=torch.bool, device=dev)
    mask = eye.repeat(parent.shape[0], 1, 1)
    chunk = torch.arange(parent.shape[0], device=dev).unsqueeze(1).expand_as(parent)
    rows = rows.expand_as(parent)
    hop = torch.where(parent >= 0, parent, -1)
    while bool((hop >= 0).any()):
        live = hop >= 0
        mask[chunk[live], rows[live], hop[live]] = True
        up = torch.full_like(hop, -1)
        up[live] = parent[chunk[live], hop[live]].clamp(min=-1)
        hop = up
    mask[parent == BLOCK] = True
    pad = parent == PAD
    mask.masked_fill_(pad.unsqueeze(1), False)
    mask[pad] = eye.expand_as(mask)[pad]
    return mask.view(*lead, t, t)


# score elements (query rows x query heads x keys) one attention tile holds at most: a
# long chunk's queries are taken in tiles of rows, so its memory is linear in the
# context, not [chunk, context]. Rows are computed independently (below), so tiling
# changes no bit.
TILE_SCORES = 1 << 20
# Batch invariance (a row's bits do not depend on the rows beside it; bench/NOTES.md): every
# reduction runs over a row's visible keys in position order, in blocks of KEY_BLOCK keys
# aligned at position 0, each block one product of a fixed shape, the blocks' partial
# sums added pairwise. A decode row and a tree node at the same position (whose
# ancestors sit anywhere in its chunk) then reduce the same numbers in the same order,
# and keys past a row's own contribute exact zeros.
KEY_BLOCK = 64
# The CPU BLAS rounds an fp32 row by the product's row count below 12 rows unless that
# count is a multiple of 4 (MKL sgemm, 1 to 8 threads); padded to a multiple of ROW_TILE,
# a row's bits are the same at any count and place (tests/test_batch_invariance.py).
# bf16 linears (oneDNN) gave every row the same bits at 1 to 200 rows unpadded, and
# padding one row to 4 cost them 2 x.
ROW_TILE = 4


def _pad_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x with zero rows appended along dim up to a multiple of ROW_TILE."""
    extra = -x.shape[dim] % ROW_TILE
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim)


def _pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim -2 as a pairwise tree over its length padded to a power of two:
    the same bits whatever number of all-zero entries trail the live ones."""
    n = x.shape[-2]
    width = 1 << max(0, n - 1).bit_length()
    if width != n:
        x = torch.cat([x, x.new_zeros(*x.shape[:-2], width - n, x.shape[-1])], -2)
    while x.shape[-2] > 1:
        x = x[..., 0::2, :] + x[..., 1::2, :]
    return x.squeeze(-2)


def paged_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         cu_q: torch.Tensor, chunk_parents: torch.Tensor,
                         scale: float, ancestors: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each chunk query over its sequence's context and chunk ancestors.

    q [total_q, q_heads, D]; caches [num_blocks, block_size, kv_heads, D] with the
    chunk's own K/V already written; block_tables [B, max_blocks] int32;
    context_lens [B]; cu_q [B + 1]; chunk_parents [total_q]. GQA: q head h reads
    kv head h // (q_heads // kv_heads). Returns [total_q, q_heads, D] in q's dtype.
    ancestors: ``tree_ancestors`` of the chunks, when every chunk has the same length
    (a speed hint for kernels; the parents alone define the result, so it is unused here).
    Batch-invariant (KEY_BLOCK): a row's result depends on its query and the keys it sees.
    Chunks of one length and kind (chains; the others) are attended together, shortest
    contexts first, as many as TILE_SCORES holds, each one's keys padded to the longest's
    blocks (trailing empty blocks add exact zeros).
    """
    out = torch.empty_like(q)
    hq, dev = q.shape[1], q.device
    cu, ctx = cu_q.tolist(), context_lens.tolist()
    by_len: dict[int, list[int]] = {}
    for b in range(len(ctx)):
        if cu[b + 1] > cu[b]:
            by_len.setdefault(cu[b + 1] - cu[b], []).append(b)
    for t, seqs in by_len.items():
        rows_of = (torch.tensor([cu[b] for b in seqs], device=dev).unsqueeze(1)
                   + torch.arange(t, device=dev))                               # [C, t]
        par = chunk_parents[rows_of]
        own, pad = chunk_mask(par), par == PAD                                  # [C, t, t]
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        chain = ([True] * len(seqs) if t == 1 else
                 ((own == causal) | pad.unsqueeze(2)).flatten(1).all(1).tolist())
        kv = 2 * k_cache.shape[2] * k_cache.shape[3]
        for kind in (True, False):      # elements laid out: scores, K and V, a tree's tails
            mine = [i for i, k in enumerate(chain) if k == kind]
            cost = [(t * hq + kv) * (ctx[seqs[i]] + t)
                    + (0 if kind else t * (hq + kv) * (ctx[seqs[i]] % KEY_BLOCK + t))
                    for i in mine]
            for pick in _batches(mine, cost):
                if pick == list(range(len(seqs))) and seqs == list(range(len(ctx))):
                    return _attend_chunks(q.view(len(seqs), t, *q.shape[1:]), k_cache, v_cache,
                                          block_tables, context_lens.long(), own, pad, kind,
                                          scale).view_as(q)         # one kind, one length
                at = torch.tensor(pick, device=dev)
                b = torch.tensor([seqs[i] for i in pick], device=dev)
                out[rows_of[at]] = _attend_chunks(q[rows_of[at]], k_cache, v_cache,
                                                  block_tables[b], context_lens[b].long(),
                                                  own[at], pad[at], kind, scale)
    return out


def _batches(items: list[int], cost: list[int]) -> list[list[int]]:
    """items in batches whose count times their largest cost (elements of scores and
    keys) stays within TILE_SCORES: all at once when they fit, else the cheapest first
    (one alone when it does not)."""
    if not items or len(items) * max(cost) <= TILE_SCORES:
        return [items] if items else []
    order = sorted(range(len(items)), key=cost.__getitem__)
    out: list[list[int]] = []
    for j in order:
        if out and (len(out[-1]) + 1) * cost[j] <= TILE_SCORES:
            out[-1].append(items[j])
        else:
            out.append([items[j]])
    return out


def _attend_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   tables: torch.Tensor, ctx: torch.Tensor, own: torch.Tensor,
                   pad: torch.Tensor, chain: bool, scale: float) -> torch.Tensor:
    """C chunks of t queries q [C, t, q_heads, D] of one kind (chains or not): their keys
    laid out once, the queries taken in row tiles when one chunk's scores pass
    TILE_SCORES (rows are computed independently, so tiling changes no bit)."""
    c, t = own.shape[:2]
    bs, kb, dev = k_cache.shape[1], KEY_BLOCK, q.device
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    longest = int(ctx.max()) + t
    pos = torch.arange(-(-longest // kb) * kb, device=dev)
    pos = torch.minimum(pos, (ctx + t - 1).unsqueeze(1))                     # [C, L]
    slots = tables.long().gather(1, pos // bs) * bs + pos % bs               # by position
    keys = _shared_keys(flat_k, flat_v, slots, ctx + t if chain else ctx // kb * kb)
    rows = max(1, TILE_SCORES // (q.shape[2] * longest))
    return torch.cat([_attend(q[:, r:r + rows], flat_k, flat_v, slots, ctx, own[:, r:r + rows],
                              pad[:, r:r + rows], chain, keys, scale)
                      for r in range(0, t, rows)], 1)


def _shared_keys(flat_k: torch.Tensor, flat_v: torch.Tensor, slots: torch.Tensor,
                 n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n [C] keys of each chunk's slots [C, L] (by position, live past n too)
    in KEY_BLOCK blocks, fp32: K [C, kv_heads, D, blocks * KEY_BLOCK], V with a ones
    column [C, kv_heads, blocks, KEY_BLOCK, D + 1] (so the product that sums p @ v sums
    p too). Keys past a chunk's n are masked out of its scores, so their p is 0."""
    kb, (c, hkv, d) = KEY_BLOCK, (slots.shape[0], *flat_k.shape[1:])
    nb = -(-int(n.max()) // kb)
    at = slots[:, :nb * kb]
    k = torch.empty(c, hkv, d, nb * kb, device=slots.device)
    k.copy_(flat_k[at].permute(0, 2, 3, 1))
    v = flat_v[at].float().transpose(1, 2)                                  # [C, hkv, S, D]
    v = torch.cat([v, v.new_ones(c, hkv, nb * kb, 1)], -1)
    return k, v.view(c, hkv, nb, kb, d + 1)


def _attend(q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, slots: torch.Tensor,
            ctx: torch.Tensor, own: torch.Tensor, pad: torch.Tensor, chain: bool,
            keys: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
    """Queries q [C, n, q_heads, D] of C chunks over their keys (flat slots [C, L] by
    position, the first ctx [C] the context, seen by every row but padding rows pad
    [C, n]; chunk key j seen by row i where own[:, i, j]). Keys are laid out by position:
    the context and, for a chain, the chunk are shared by a chunk's rows (``keys``:
    _shared_keys); a tree row's blocks from the context's last whole block on are its
    own: the context's tail, then its ancestors-or-self in chunk order (= depth order),
    then masked keys. Returns [C, n, q_heads, D] in q's dtype."""
    c, n, hq, d = q.shape
    hkv = flat_k.shape[1]
    g = hq // hkv
    kb, dev, t = KEY_BLOCK, q.device, own.shape[2]
    k_s, v_s = keys
    nbs = v_s.shape[2]
    # shared keys: row (query i, q head of the group; padded to ROW_TILE) sees [lo, hi]
    if chain:       # causal up to the row itself (its last visible chunk key); padding: itself
        first = ctx.unsqueeze(1) + (own * torch.arange(t, device=dev)).amax(2)
        lo, hi = torch.where(pad, first, 0), first
    else:           # the context's whole blocks; a padding row none
        lo, hi = pad.long(), (ctx // kb * kb - 1).unsqueeze(1).expand(c, n)
    lo, hi = (_pad_rows(x.repeat_interleave(g, 1), 1).unsqueeze(1) for x in (lo, hi))  # [C,1,M]
    qg = q.float().view(c, n, hkv, g, d)
    rows = _pad_rows(qg.transpose(1, 2).reshape(c, hkv, n * g, d), 2)      # [C, hkv, M, D]
    m = rows.shape[2]
    pos = torch.arange(nbs * kb, device=dev)
    s_s = torch.matmul(rows, k_s).mul_(scale)                               # [C, hkv, M, S]
    s_s.masked_fill_((pos < lo[..., None]) | (pos > hi[..., None]), float("-inf"))
    top = (s_s.amax(-1) if nbs else torch.full((c, hkv, m), float("-inf"), device=dev))
    top = top[..., :n * g].reshape(c, hkv, n, g).transpose(1, 2)            # [C, n, hkv, g]
    if not chain:       # the tail: [ctx0, ctx) of the context, then each row's ancestors
        shared = ctx // kb * kb
        nbt = -(-int((ctx - shared).max() + t) // kb)
        at = shared.unsqueeze(1) + torch.arange(nbt * kb, device=dev)       # [C, T] position
        rank = (at - ctx.unsqueeze(1)).unsqueeze(1)                         # [C, 1, T] in chunk
        seen = torch.arange(t, device=dev).expand(c, n, t)
        order = torch.where(own, seen, seen + t).sort(2).values % t         # seen first
        ahead = order.gather(2, rank.clamp(0, t - 1).expand(c, n, -1))
        at = torch.where(rank < 0, at.unsqueeze(1), ctx[:, None, None] + ahead)
        idx = slots.gather(1, at.view(c, -1)).view(c, n, -1)                # [C, n, T]
        vis_t = torch.where(rank < 0, ~pad.unsqueeze(2), rank < own.sum(2, keepdim=True))
        k_t = flat_k[idx].float().view(c, n, nbt, kb, hkv, d).permute(0, 1, 4, 2, 5, 3)
        v_t = torch.ones(c, n, nbt * kb, hkv, d + 1, device=dev)
        v_t[..., :d] = flat_v[idx].masked_fill(~vis_t[..., None, None], 0)
        v_t = v_t.view(c, n, nbt, kb, hkv, d + 1).permute(0, 1, 4, 2, 3, 5)  # [C,n,hkv,nbt,kb,D+1]
        q_t = _pad_rows(qg, 3).unsqueeze(3)                                   # [C, n, hkv, 1, G, D]
        s_t = torch.matmul(q_t, k_t.contiguous()).mul_(scale)                # [C,n,hkv,nbt,G,kb]
        s_t.masked_fill_(~vis_t.view(c, n, 1, nbt, 1, kb), float("-inf"))
        top = torch.maximum(top, s_t.amax((3, 5))[..., :g])
    top_rows = _pad_rows(top.transpose(1, 2).reshape(c, hkv, n * g), 2)      # [C, hkv, M]
    p_s = s_s.sub_(top_rows.unsqueeze(-1)).exp_().view(c, hkv, m, nbs, kb).transpose(2, 3)
    part = torch.matmul(p_s.contiguous(), v_s)[..., :n * g, :]              # [C,hkv,nbs,n*g,D+1]
    part = part.reshape(c, hkv, nbs, n, g, d + 1).permute(0, 3, 1, 4, 2, 5)  # [C,n,hkv,g,nbs,D+1]
    if not chain:
        p_t = s_t.sub_(_pad_rows(top, 3)[:, :, :, None, :, None]).exp_()
        part_t = torch.matmul(p_t, v_t)[..., :g, :].transpose(3, 4)          # [C,n,hkv,g,nbt,D+1]
        part = _by_position(part, part_t, shared // kb)
    acc = _pairwise_sum(part)                                                # [C, n, hkv, g, D+1]
    return (acc[..., :d] / acc[..., d:]).reshape(c, n, hq, d).to(q.dtype)


def _by_position(shared: torch.Tensor, tail: torch.Tensor, blocks: torch.Tensor
                 ) -> torch.Tensor:
    """Each chunk's blocks in position order: its blocks[c] shared ones (of [..., S, D+1]
    padded with zero blocks), then its tail's [..., T, D+1], then zero blocks."""
    s, width = shared.shape[-2], shared.shape[-2] + tail.shape[-2]
    both = torch.cat([shared, tail], -2)
    if bool((blocks == s).all()):
        return both
    w = torch.arange(width, device=blocks.device)
    src = torch.where(w < blocks.unsqueeze(1), w, w - blocks.unsqueeze(1) + s)    # [C, W]
    src = torch.where(src < width, src, blocks.unsqueeze(1))     # past the tail: a zero block
    return both.gather(-2, src[:, None, None, None, :, None].expand(*both.shape))
