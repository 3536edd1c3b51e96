"""The paged tree attention's batch-invariant mode (the Triton backend of
``--kernels invariant``, ``treespec verify --batch-invariant on``): the kernels and the
launcher behind ``treespec.kernels.triton_tree_attention.paged_tree_attention(...,
invariant=True)``, which checks the inputs and hands them here.

A row's result depends on its query
and the keys it sees, never on the rows beside it, so a decode row, a prefill chunk's
row and a tree node at the same position (ctx + depth, its path the committed tokens)
give the same bits. Every row reduces its visible keys laid out by position: the context,
then (a tree node) its ancestors-or-self in depth order, read by position, not by chunk
index. The keys are cut into chunks of SPLIT_KEYS from position 0, each an online softmax
over BLOCK_N-key tiles aligned at 0 (masked lanes hold zeros), and the chunks' states are
folded in position order (``_fold``). Whether one program folds all of a query tile's
chunks in registers or each chunk gets a program and ``_fold_chunks_kernel`` folds
their partials is the same arithmetic, so that choice may follow the batch; the tile
shape (BLOCK_M rows, BLOCK_N keys, 4 warps) and SPLIT_KEYS are constants. Tiles below
the context's last whole tile are shared by a query tile's rows; a tree's tiles from
there on are gathered per query (its context tail, then its ancestors walked up from
it). Under the interpreter tl.dot is numpy's matmul, which may round a row by its place
in the tile: there the products are summed in fp64 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treespec.kernels.triton_common import interpreted, launch_options, next_pow2, pdl_enter
from treespec.kernels.triton_tree_attention import LOG2E, _dot, _num_sms

# the invariant mode's reduction order (a row's bits depend on these, never on the batch)
INVARIANT_BLOCK_M = 16      # query rows (queries x GROUP q heads) per tile: one MMA shape
INVARIANT_BLOCK_N = 64      # keys per tile, tiles aligned at position 0
INVARIANT_SPLIT_KEYS = 256  # keys per chunk, chunks aligned at position 0


# The invariant kernel's reductions: triton.language's own max / sum combines, the same
# tl.reduce / tl.associative_scan as vmax / vsum / vcumsum compiled; the interpreter runs
# these as numpy's (fast) instead of element by element (it calls no combine function,
# so it does not matter whether triton was imported before TRITON_INTERPRET was set).
@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _cumsum(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, tl.standard._sum_combine)


@triton.jit
def _invariant_update(q, k, v, visible, m_i, l_i, acc, qk_scale,
                      PREC: tl.constexpr, DOT: tl.constexpr):
    """_online_update with _max / _sum."""
    s = _dot(q, tl.trans(k), PREC, DOT) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, _max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + _sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, DOT)
    return m_new, l_i, acc


@triton.jit
def _fold(m, l, acc, m_c, l_c, acc_c):
    """Two softmax states (fp32 max, sum, unnormalised output rows) as one: the state so
    far and the next key chunk's. fma pins the roundings, so the kernel's in-register
    fold and _fold_chunks_kernel's give the same bits."""
    m_new = tl.maximum(m, m_c)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m - m_use)
    b = tl.exp2(m_c - m_use)
    return m_new, tl.fma(l, a, l_c * b), tl.fma(acc, a[:, None], acc_c * b[:, None])


@triton.jit
def _normalise(acc, l):
    return acc / tl.where(l > 0, l, 1.0)[:, None]


@triton.jit
def _ancestor_at(par_chunk, tok, depth, e, ok, steps):
    """Per lane where ok, the chunk index of query tok's ancestor-or-self at depth e (tok
    at depth `depth`): `depth - e` steps up its parents, all lanes walking together."""
    cur = tl.full(e.shape, 0, dtype=tl.int32) + tok
    need = tl.where(ok, depth - e, 0)
    for k in range(0, steps):
        cur = tl.where(k < need, tl.load(par_chunk + cur, mask=k < need, other=0), cur)
    return cur


@triton.jit
def _keys(k_base, v_base, bt_row, pos, ok, s_ks, s_vs, d, BS: tl.constexpr):
    """K and V [BLOCK_N, D] of the sequence's positions pos (zeros where not ok)."""
    page = tl.load(bt_row + pos // BS, mask=ok, other=0).to(tl.int64)
    slot = (page * BS + pos % BS)[:, None]
    k = tl.load(k_base + slot * s_ks + d[None, :], mask=ok[:, None], other=0.0)
    v = tl.load(v_base + slot * s_vs + d[None, :], mask=ok[:, None], other=0.0)
    return k, v


@triton.jit(do_not_specialize=["num_seqs", "total_q", "s_bt"])
def _invariant_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, cu_ptr, par_ptr,
        out_ptr, acc_ws, m_ws, l_ws, n_ws,
        num_seqs, total_q, num_q_heads, qk_scale,
        s_qt, s_qh, s_ks, s_kh, s_vs, s_vh, s_bt, s_ot, s_oh,
        GROUP: tl.constexpr, BT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT_KEYS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_B: tl.constexpr,
        SPLIT: tl.constexpr, PREC: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    """One program per (query tile, kv head, key chunk if SPLIT else all chunks). A row
    at logical position p (context + depth) reduces keys 0..p laid out by position:
    chunks of SPLIT_KEYS keys from 0, each an online softmax over BLOCK_N-key tiles
    from a fresh state, folded in order (here, or by _fold_chunks_kernel)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    sb = tl.arange(0, BLOCK_B)
    lo = tl.load(cu_ptr + sb, mask=sb < num_seqs, other=0)
    hi = tl.load(cu_ptr + sb + 1, mask=sb < num_seqs, other=0)
    tiles = (hi - lo + BT - 1) // BT
    b = _sum((_cumsum(tiles, 0) <= pid).to(tl.int32), 0)
    if b >= num_seqs:
        return
    t0 = (pid - _sum(tl.where(sb < b, tiles, 0), 0)) * BT
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    ctx = tl.load(ctx_ptr + b)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    par_chunk = par_ptr + q_start

    r = tl.arange(0, BLOCK_M)
    tok = t0 + r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = (r < BT * GROUP) & (tok < q_len)
    qrow = (q_start + tok).to(tl.int64)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + qrow[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    row_parent = tl.load(par_chunk + tok, mask=row_ok, other=-2)
    sees_ctx = row_ok & (row_parent != -2)
    k_base = k_ptr + kvh.to(tl.int64) * s_kh
    v_base = v_ptr + kvh.to(tl.int64) * s_vh

    # each row's keys end at kend (exclusive, logical): a chain row's causal prefix; a tree
    # row's ancestors-or-self at ctx + depth (padding: itself at ctx); a BLOCK row's chunk
    t_end = tl.minimum(t0 + BT, q_len)
    not_chain = q_len * 0
    for c0 in range(0, t_end, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)
        pc = tl.load(par_chunk + c, mask=c < t_end, other=0)
        not_chain += _sum(((c < t_end) & (pc != c - 1)).to(tl.int32), 0)
    if not_chain == 0:
        kend = ctx + tok + 1
    else:
        depth = tl.full([BLOCK_M], 0, dtype=tl.int32)
        p = tl.where(row_ok, row_parent, -1)
        steps = q_len * 0
        while (_max(p, 0) >= 0) & (steps < q_len):
            up = p >= 0
            depth += up.to(tl.int32)
            p = tl.where(up, tl.load(par_chunk + p, mask=up, other=-1), -1)
            steps += 1
        kend = ctx + tl.where(row_parent == -3, q_len, depth + 1)
    kend = tl.where(row_ok, kend, 0)
    kend_max = _max(kend, 0)
    # tiles below `shared` hold the same keys in the same lanes for every row of the tile
    shared = tl.where(not_chain == 0, kend_max, ctx // BLOCK_N * BLOCK_N)

    n_chunks = (kend_max + SPLIT_KEYS - 1) // SPLIT_KEYS
    if SPLIT:
        if (split == 0) & (kvh == 0):
            tl.store(n_ws + qrow, (kend + SPLIT_KEYS - 1) // SPLIT_KEYS,
                     mask=row_ok & (r % GROUP == 0))
        c_first = split
        c_last = tl.minimum(split + 1, n_chunks)
    else:
        c_first = 0
        c_last = n_chunks
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, D], 0.0, dtype=tl.float32)
    for ch in range(c_first, c_last):
        c_lo = ch * SPLIT_KEYS
        c_hi = tl.minimum(c_lo + SPLIT_KEYS, kend_max)
        m_c = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_c = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        acc_c = tl.full([BLOCK_M, D], 0.0, dtype=tl.float32)
        for n0 in range(c_lo, tl.minimum(c_hi, shared), BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            k, v = _keys(k_base, v_base, bt_row, j, j < kend_max, s_ks, s_vs, d, BS)
            visible = sees_ctx[:, None] & (j[None, :] < kend[:, None])
            m_c, l_c, acc_c = _invariant_update(q, k, v, visible, m_c, l_c, acc_c, qk_scale,
                                                PREC, DOT)
        # a tree's tiles from the context's last whole tile on: per query, its context
        # tail then its ancestors in depth order
        for n0 in range(tl.maximum(c_lo, shared), c_hi, BLOCK_N):
            x = n0 + tl.arange(0, BLOCK_N)
            e = x - ctx
            for qi in range(0, BT):
                mine = row_ok & (tok == t0 + qi)
                kend_q = _max(tl.where(mine, kend, 0), 0)
                if n0 < kend_q:
                    par_q = _max(tl.where(mine, row_parent, -4), 0)
                    span = kend_q - ctx             # ancestors-or-self (BLOCK: the chunk)
                    own = (e >= 0) & (e < span)
                    if par_q == -3:
                        jc = tl.maximum(e, 0)
                        own = own & (tl.load(par_chunk + jc, mask=own, other=-2) != -2)
                    else:
                        jc = _ancestor_at(par_chunk, t0 + qi, span - 1, e, own,
                                          span - 1 - tl.maximum(n0 - ctx, 0))
                    in_ctx = x < ctx
                    lane_ok = (in_ctx & (x * 0 + par_q != -2)) | ((x >= ctx) & own)
                    k, v = _keys(k_base, v_base, bt_row, tl.where(in_ctx, x, ctx + jc),
                                 lane_ok, s_ks, s_vs, d, BS)
                    visible = mine[:, None] & lane_ok[None, :]
                    m_c, l_c, acc_c = _invariant_update(q, k, v, visible, m_c, l_c, acc_c,
                                                        qk_scale, PREC, DOT)
        if SPLIT:
            ws = (ch * total_q + qrow) * num_q_heads + head
            tl.store(acc_ws + ws[:, None] * D + d[None, :], acc_c, mask=row_ok[:, None])
            tl.store(m_ws + ws, m_c, mask=row_ok)
            tl.store(l_ws + ws, l_c, mask=row_ok)
        else:
            m_i, l_i, acc = _fold(m_i, l_i, acc, m_c, l_c, acc_c)
    if not SPLIT:
        tl.store(out_ptr + qrow[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
                 _normalise(acc, l_i).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["total_q"])
def _fold_chunks_kernel(acc_ws, m_ws, l_ws, n_ws, out_ptr, total_q, num_q_heads, s_ot, s_oh,
                        BLOCK_H: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    """One program per query: its key chunks' partials folded in position order."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    h_ok = h < num_q_heads
    d = tl.arange(0, D)
    n = tl.load(n_ws + row)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, D], 0.0, dtype=tl.float32)
    for ch in range(0, n):
        ws = (ch * total_q + row) * num_q_heads + h
        m_c = tl.load(m_ws + ws, mask=h_ok, other=float("-inf"))
        l_c = tl.load(l_ws + ws, mask=h_ok, other=0.0)
        acc_c = tl.load(acc_ws + ws[:, None] * D + d[None, :], mask=h_ok[:, None], other=0.0)
        m, l, acc = _fold(m, l, acc, m_c, l_c, acc_c)
    tl.store(out_ptr + row * s_ot + h[:, None] * s_oh + d[None, :],
             _normalise(acc, l).to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


def _plan_invariant(total_q: int, num_seqs: int, group: int, kv_heads: int, table_keys: int,
                    device: torch.device, split: bool | None, block_m: int | None,
                    block_n: int | None, split_keys: int | None) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, SPLIT_KEYS, split) for the invariant kernel. The tile shapes
    and the chunk size are constants (a row's bits depend on them); only whether each
    key chunk gets its own program follows the batch, which changes no bit."""
    block_m = max(block_m or INVARIANT_BLOCK_M, next_pow2(group))
    block_n = block_n or INVARIANT_BLOCK_N
    split_keys = split_keys or INVARIANT_SPLIT_KEYS
    if split_keys % block_n:
        raise ValueError(f"paged_tree_attention: split_keys {split_keys} is not a multiple "
                         f"of block_n {block_n}")
    if split is None:
        tiles = num_seqs * triton.cdiv(triton.cdiv(total_q, num_seqs), block_m // group)
        split = table_keys > split_keys and tiles * kv_heads < 2 * _num_sms(device)
    return block_m, block_n, split_keys, split


def _launch_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor, cu_q: torch.Tensor,
                      chunk_parents: torch.Tensor, scale: float, out: torch.Tensor,
                      split: bool | None, block_m: int | None, block_n: int | None,
                      split_keys: int | None) -> torch.Tensor:
    total_q, hq, d = q.shape
    nseq = block_tables.shape[0]
    _, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    table_keys = block_tables.shape[1] * bs
    block_m, block_n, split_keys, split = _plan_invariant(
        total_q, nseq, group, hkv, table_keys, q.device, split, block_m, block_n, split_keys)
    bt = block_m // group
    chunks = triton.cdiv(table_keys, split_keys) if split else 1
    grid = (min(total_q, triton.cdiv(total_q, bt) + nseq - 1), hkv, chunks)
    if split:
        acc_ws = torch.empty((chunks, total_q, hq, d), dtype=torch.float32, device=q.device)
        m_ws = torch.empty((chunks, total_q, hq), dtype=torch.float32, device=q.device)
        l_ws = torch.empty_like(m_ws)
        n_ws = torch.empty((total_q,), dtype=torch.int32, device=q.device)
    else:
        acc_ws = m_ws = l_ws = n_ws = out
    interp = interpreted(_invariant_kernel)
    _invariant_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, cu_q, chunk_parents,
        out, acc_ws, m_ws, l_ws, n_ws,
        nseq, total_q, hq, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BT=bt, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_KEYS=split_keys, D=d, BS=bs,
        BLOCK_B=max(64, next_pow2(nseq)), SPLIT=split,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", DOT=2 if interp else 0,
        num_warps=4, **launch_options(_invariant_kernel, q.device))
    if split:
        _fold_chunks_kernel[(total_q,)](
            acc_ws, m_ws, l_ws, n_ws, out, total_q, hq, out.stride(0), out.stride(1),
            BLOCK_H=next_pow2(hq), D=d, num_warps=4,
            **launch_options(_fold_chunks_kernel, q.device))
    return out
