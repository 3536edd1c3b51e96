"""Paged tree attention (Triton), with its launcher.

Semantics and layout are ``treespec.kernels.reference.paged_tree_attention``: each chunk
query attends to its sequence's ``context_lens[b]`` committed slots and to its
chunk ancestors-or-self given by ``chunk_parents`` (padding sees only itself,
nobody sees padding). Prefill, decode and tree verify all run through it.

Design
* One program per (query tile, kv head, context split). A query tile is BT
  consecutive queries of one chunk times the GROUP q heads that share the kv head,
  packed as BLOCK_M = BT * GROUP rows, so GQA reads each K/V tile once for all its
  q heads and even decode (one query) feeds tl.dot >= 16 rows. Programs find their
  chunk from cu_q in registers (a cumsum over per-chunk tile counts), so the grid is
  fixed by host-known sizes and nothing syncs with the host.
* K/V are read only from live pages: key j of sequence b is slot
  ``block_tables[b, j // block_size] * block_size + j % block_size``, gathered
  BLOCK_N keys at a time. No dense mask exists anywhere.
* Context keys are all visible (except to padding rows). Chunk keys use a mask built
  in registers from chunk_parents: if the chunk's prefix up to the tile's last
  query is a chain (prefill, decode, chain speculation) the mask is causal;
  otherwise, per window of CHUNK_N <= 64 keys, each query row's ancestors inside it
  become an int64 bitmask, and key j is visible to row i iff j == i or bit
  (j - window) is set. The bits come from ``ancestors`` (kernels/triton_ancestors.py,
  one small kernel per forward for fixed-shape trees) when given, else by walking
  parents up in every program. A BLOCK row (DFlash) sees every non-padding key.
* Online softmax in base 2 with fp32 statistics and accumulator; scores for fp32
  inputs use IEEE dot products (no TF32).
* Split-K: with few programs (small batch, decode) the work is cut into NUM_SPLITS
  parts; each writes an unnormalised partial (acc, max, sum) and a small kernel
  combines them. The last part is the chunk keys (a 64-node tree's ancestor windows
  cost as much as a context span); the others cut the context, on the device, from
  each sequence's own length into at most NUM_SPLITS - 1 spans of >= MIN_SPLIT keys.

Its batch-invariant mode (``invariant=True``): kernels/triton_tree_attention_invariant.py.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from treespec.kernels.triton_common import (FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_dtype,
                                   check_paged, check_shape, check_unit_last, interpreted, launch_options,
                                   next_pow2, pdl_enter, vcumsum, vmax, vsum)

LOG2E = 1.4426950408889634
MIN_SPLIT_KEYS = 128    # a context split shorter than this never paid for its partials
PLAN_MIN_KEYS = 4096    # the keys a captured step's smallest table holds (256 pages of 16)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, DOT: tl.constexpr):
    """a @ b in fp32. DOT 0: native (PREC); 1: IEEE fp32 (the interpreter's tl.dot
    mishandles bf16: numpy has none); 2: fp64 rounded once (the interpreter in invariant
    mode: numpy's matmul may round a row by its place in the tile)."""
    if DOT == 2:
        return tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee").to(tl.float32)
    elif DOT == 1:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _online_update(q, k, v, visible, m_i, l_i, acc, qk_scale,
                   PREC: tl.constexpr, DOT: tl.constexpr):
    s = _dot(q, tl.trans(k), PREC, DOT) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, vmax(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + vsum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, DOT)
    return m_new, l_i, acc


@triton.jit
def _ancestor_bits(par_ptr, row_parent, w0, limit, WINDOW: tl.constexpr):
    """Per row, bit (a - w0) for each non-padding ancestor a in [w0, w0 + WINDOW)."""
    p = row_parent
    bits = tl.full(row_parent.shape, 0, dtype=tl.int64)
    one = tl.full(row_parent.shape, 1, dtype=tl.int64)
    steps = limit * 0
    while (vmax(p, 0) >= 0) & (steps < limit):
        up = p >= 0
        pp = tl.load(par_ptr + p, mask=up, other=-1)
        hit = up & (pp != -2) & (p >= w0) & (p < w0 + WINDOW)
        shift = tl.where(hit, p - w0, 0).to(tl.int64)
        bits = bits | tl.where(hit, one << shift, 0)
        p = tl.where(up, pp, -1)
        steps += 1
    return bits


# step-varying sizes unspecialized (== 1, % 16): a new combination = a compile mid-serving
@triton.jit(do_not_specialize=["num_seqs", "total_q", "anc_words", "s_bt"])
def _tree_attention_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, cu_ptr, par_ptr, anc_ptr,
        out_ptr, acc_ws, m_ws, l_ws,
        num_seqs, total_q, num_q_heads, qk_scale, anc_words,
        s_qt, s_qh, s_ks, s_kh, s_vs, s_vh, s_bt, s_ot, s_oh,
        GROUP: tl.constexpr, BT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CHUNK_N: tl.constexpr,
        D: tl.constexpr, BS: tl.constexpr, BLOCK_B: tl.constexpr, NUM_SPLITS: tl.constexpr,
        MIN_SPLIT: tl.constexpr, HAS_ANC: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # which chunk and which of its query tiles this program takes
    sb = tl.arange(0, BLOCK_B)
    lo = tl.load(cu_ptr + sb, mask=sb < num_seqs, other=0)
    hi = tl.load(cu_ptr + sb + 1, mask=sb < num_seqs, other=0)
    tiles = (hi - lo + BT - 1) // BT
    b = vsum((vcumsum(tiles, 0) <= pid).to(tl.int32), 0)
    if b >= num_seqs:
        return
    t0 = (pid - vsum(tl.where(sb < b, tiles, 0), 0)) * BT
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    ctx = tl.load(ctx_ptr + b)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    par_chunk = par_ptr + q_start

    r = tl.arange(0, BLOCK_M)
    tok = t0 + r // GROUP                       # chunk-local query index of each row
    head = kvh * GROUP + r % GROUP
    row_ok = (r < BT * GROUP) & (tok < q_len)
    qrow = (q_start + tok).to(tl.int64)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + qrow[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    row_parent = tl.load(par_chunk + tok, mask=row_ok, other=-2)
    sees_ctx = row_ok & (row_parent != -2)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, D], 0.0, dtype=tl.float32)
    k_base = k_ptr + kvh.to(tl.int64) * s_kh
    v_base = v_ptr + kvh.to(tl.int64) * s_vh

    # committed context: every key visible to every non-padding row
    if NUM_SPLITS == 1:
        c_lo = ctx * 0
        c_hi = ctx
    else:
        # the last split takes the chunk keys alone; the others share the context, cut
        # here from this sequence's own length (the page bucket the host planned with
        # can be twice the live context) into spans of >= MIN_SPLIT keys
        ctx_splits = tl.minimum(NUM_SPLITS - 1, tl.maximum(1, (ctx + MIN_SPLIT - 1) // MIN_SPLIT))
        blocks = (ctx + BLOCK_N - 1) // BLOCK_N
        span = (blocks + ctx_splits - 1) // ctx_splits * BLOCK_N
        c_lo = split * span
        c_hi = tl.where(split < ctx_splits, tl.minimum(ctx, c_lo + span), c_lo)
    for n0 in range(c_lo, c_hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        j_ok = j < c_hi
        page = tl.load(bt_row + j // BS, mask=j_ok, other=0).to(tl.int64)
        slot = (page * BS + j % BS)[:, None]
        k = tl.load(k_base + slot * s_ks + d[None, :], mask=j_ok[:, None], other=0.0)
        v = tl.load(v_base + slot * s_vs + d[None, :], mask=j_ok[:, None], other=0.0)
        visible = sees_ctx[:, None] & j_ok[None, :]
        m_i, l_i, acc = _online_update(q, k, v, visible, m_i, l_i, acc, qk_scale, PREC, DOT_F32)

    if split == NUM_SPLITS - 1:             # the chunk itself: ancestors-or-self
        t_end = tl.minimum(t0 + BT, q_len)
        not_chain = q_len * 0
        for c0 in range(0, t_end, CHUNK_N):
            c = c0 + tl.arange(0, CHUNK_N)
            pc = tl.load(par_chunk + c, mask=c < t_end, other=0)
            not_chain += vsum(((c < t_end) & (pc != c - 1)).to(tl.int32), 0)
        k_end = tl.where(not_chain == 0, t_end, q_len)
        for n0 in range(0, k_end, CHUNK_N):
            jc = n0 + tl.arange(0, CHUNK_N)
            j_ok = jc < k_end
            pos = ctx + jc
            page = tl.load(bt_row + pos // BS, mask=j_ok, other=0).to(tl.int64)
            slot = (page * BS + pos % BS)[:, None]
            k = tl.load(k_base + slot * s_ks + d[None, :], mask=j_ok[:, None], other=0.0)
            v = tl.load(v_base + slot * s_vs + d[None, :], mask=j_ok[:, None], other=0.0)
            if not_chain == 0:
                visible = jc[None, :] <= tok[:, None]
            else:
                if HAS_ANC:     # CHUNK_N divides 64: a window never straddles two words
                    bits = tl.load(anc_ptr + qrow * anc_words + n0 // 64, mask=row_ok,
                                   other=0) >> (n0 % 64)
                else:
                    bits = _ancestor_bits(par_chunk, row_parent, n0, q_len, CHUNK_N)
                shift = (jc - n0).to(tl.int64)
                visible = ((bits[:, None] >> shift[None, :]) & 1) != 0
                visible = visible | (jc[None, :] == tok[:, None])
                if vmax((row_parent == -3).to(tl.int32), 0) > 0:
                    kp = tl.load(par_chunk + jc, mask=j_ok, other=-2)
                    visible = visible | ((row_parent == -3)[:, None] & (kp != -2)[None, :])
            visible = visible & j_ok[None, :] & row_ok[:, None]
            m_i, l_i, acc = _online_update(q, k, v, visible, m_i, l_i, acc, qk_scale, PREC, DOT_F32)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + qrow[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        ws = (split.to(tl.int64) * total_q + qrow) * num_q_heads + head
        tl.store(acc_ws + ws[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(m_ws + ws, m_i, mask=row_ok)
        tl.store(l_ws + ws, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["total_q"])
def _combine_splits_kernel(acc_ws, m_ws, l_ws, out_ptr, total_q, num_q_heads, s_ot, s_oh,
                           NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr,
                           PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)          # = query * num_q_heads + head
    t = row // num_q_heads
    h = row % num_q_heads
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    ws = s.to(tl.int64) * total_q * num_q_heads + row
    m = tl.load(m_ws + ws, mask=s_ok, other=float("-inf"))
    l = tl.load(l_ws + ws, mask=s_ok, other=0.0)
    m_max = vmax(m, 0)
    w = tl.where(s_ok & (m > float("-inf")), tl.exp2(m - m_max), 0.0)
    d = tl.arange(0, D)
    acc = tl.load(acc_ws + ws[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = vsum(acc * w[:, None], 0) / vsum(l * w, 0)
    tl.store(out_ptr + t * s_ot + h * s_oh + d, out.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def _plan(total_q: int, num_seqs: int, group: int, kv_heads: int, max_ctx: int,
          device: torch.device, num_splits: int | None, block_m: int | None,
          block_n: int | None, tree: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_splits, num_warps) from host-known sizes only."""
    rows_per_chunk = total_q * group / max(1, num_seqs)
    if block_m is None:
        block_m = 16 if rows_per_chunk <= 16 else 64 if rows_per_chunk <= 256 else 128
    block_m = max(block_m, next_pow2(group))
    if block_n is None:
        block_n = 64
    bt = block_m // group
    tiles = num_seqs * triton.cdiv(triton.cdiv(total_q, num_seqs), bt)
    if num_splits is None:
        # Measured on an H200 under CUDA graphs (Qwen3-8B heads, ctx 1024): decode wants
        # ~2 programs per SM, tree chunks ~1 (their last split also carries the chunk
        # keys, and partials cost traffic); splits shorter than 128 keys never paid.
        # max_ctx is the table's width (a captured step's page bucket): plan for half of
        # it, the spans being cut on the device from the live length (attention_probe:
        # 9 splits beat 17 by 1-2 µs a layer at ctx 1024 in a 2048-slot bucket).
        # A compile-time constant, so only 1, 2, 3, 5, 9, 17 (rounded down), and 1 for
        # long chains (BLOCK_M 128, not a tree: prefills and catch-ups, run eagerly at
        # lengths no warm-up enumerates): shapes met while serving find a compiled kernel.
        per_sm = 2 if rows_per_chunk <= 16 else 0 if block_m >= 128 and not tree else 1
        want = (per_sm * _num_sms(device)) // max(1, tiles * kv_heads)
        # An eager call's table is its context's own width: planned from it, a catch-up
        # would compile a kernel per context range while serving (an H200's draft at ctx
        # 4096: two 1.4-1.7 s steps, past the verify's deadline). So plan for at least a
        # captured step's smallest table (PLAN_MIN_KEYS): the count then follows the
        # batch's shape only, which the warm-up covers; unused splits find nothing to read.
        n = max(1, min(want, triton.cdiv(max(max_ctx, PLAN_MIN_KEYS), 2 * MIN_SPLIT_KEYS) + 1,
                       17))
        num_splits = n if n <= 2 else (1 << (n - 1).bit_length() - 1) + 1
    num_warps = 8 if block_m >= 128 else 4
    return block_m, block_n, num_splits, num_warps




def paged_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         cu_q: torch.Tensor, chunk_parents: torch.Tensor, scale: float,
                         ancestors: torch.Tensor | None = None, *,
                         num_splits: int | None = None, block_m: int | None = None,
                         block_n: int | None = None, invariant: bool = False,
                         split: bool | None = None, split_keys: int | None = None
                         ) -> torch.Tensor:
    """Attention of each chunk query over its sequence's context and chunk ancestors.

    q [total_q, q_heads, D]; caches [num_blocks, block_size, kv_heads, D] with the
    chunk's K/V already written; block_tables [B, max_blocks]; context_lens [B];
    cu_q [B + 1]; chunk_parents [total_q]. D a power of two >= 16. Returns
    [total_q, q_heads, D] in q's dtype. The keyword arguments override the tiling
    (tests use them to force splits and small tiles). ancestors: ``tree_ancestors``
    of the chunks, all of one length (see treespec.kernels.reference.paged_tree_attention).

    invariant: the batch-invariant kernel (kernels/triton_tree_attention_invariant.py; ancestors
    and num_splits unused): split forces one program per key chunk (True) or per query
    tile (False), bit-neutral; block_m, block_n and split_keys (default
    INVARIANT_BLOCK_M, INVARIANT_BLOCK_N, INVARIANT_SPLIT_KEYS) set the reduction order.
    """
    where = "paged_tree_attention"
    check_devices(_tree_attention_kernel, where, q=q, k_cache=k_cache, v_cache=v_cache,
                  block_tables=block_tables, context_lens=context_lens, cu_q=cu_q,
                  chunk_parents=chunk_parents)
    check_dtype(where, "q", q, FLOAT_DTYPES)
    check_shape(where, "q", q, (None, None, None))
    total_q, hq, d = q.shape
    check_unit_last(where, "q", q)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{where}: {name} dtype {t.dtype} != q dtype {q.dtype}")
        check_shape(where, name, t, (None, None, None, d))
        check_paged(where, name, t, 0)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{where}: v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    _, bs, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"{where}: q_heads {hq} is not a multiple of kv_heads {hkv}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"{where}: head_dim must be a power of two >= 16, got {d}")
    check_shape(where, "block_tables", block_tables, (None, None))
    nseq = block_tables.shape[0]
    check_unit_last(where, "block_tables", block_tables)
    for name, t, n in (("block_tables", block_tables, None), ("context_lens", context_lens, nseq),
                       ("cu_q", cu_q, nseq + 1), ("chunk_parents", chunk_parents, total_q)):
        check_dtype(where, name, t, INDEX_DTYPES)
        if n is not None:
            check_shape(where, name, t, (n,))
    if not math.isfinite(scale):
        raise ValueError(f"{where}: scale must be finite, got {scale}")
    if ancestors is not None:
        check_dtype(where, "ancestors", ancestors, (torch.int64,))
        check_shape(where, "ancestors", ancestors, (total_q, None))
        check_unit_last(where, "ancestors", ancestors)
    out = torch.empty((total_q, hq, d), dtype=q.dtype, device=q.device)
    if total_q == 0 or nseq == 0:
        return out
    context_lens, cu_q, chunk_parents = (t.contiguous() for t in (context_lens, cu_q, chunk_parents))
    group = hq // hkv
    if invariant:
        from treespec.kernels.triton_tree_attention_invariant import _launch_invariant
        return _launch_invariant(q, k_cache, v_cache, block_tables, context_lens, cu_q,
                                 chunk_parents, scale, out, split, block_m, block_n, split_keys)
    block_m, block_n, splits, warps = _plan(total_q, nseq, group, hkv, block_tables.shape[1] * bs,
                                            q.device, num_splits, block_m, block_n, ancestors is not None)
    bt = block_m // group
    grid = (min(total_q, triton.cdiv(total_q, bt) + nseq - 1), hkv, splits)
    if splits > 1:
        acc_ws = torch.empty((splits, total_q, hq, d), dtype=torch.float32, device=q.device)
        m_ws = torch.empty((splits, total_q, hq), dtype=torch.float32, device=q.device)
        l_ws = torch.empty_like(m_ws)
    else:
        acc_ws = m_ws = l_ws = out
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, cu_q, chunk_parents,
        chunk_parents if ancestors is None else ancestors,
        out, acc_ws, m_ws, l_ws,
        nseq, total_q, hq, scale * LOG2E,
        0 if ancestors is None else ancestors.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BT=bt, BLOCK_M=block_m, BLOCK_N=block_n, CHUNK_N=min(block_n, 64), D=d, BS=bs,
        BLOCK_B=max(64, next_pow2(nseq)), NUM_SPLITS=splits, MIN_SPLIT=MIN_SPLIT_KEYS,
        HAS_ANC=ancestors is not None, PREC="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=interpreted(_tree_attention_kernel) and q.dtype == torch.bfloat16,
        num_warps=warps, **launch_options(_tree_attention_kernel, q.device))
    if splits > 1:
        _combine_splits_kernel[(total_q * hq,)](
            acc_ws, m_ws, l_ws, out, total_q, hq, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, BLOCK_S=next_pow2(splits), D=d, num_warps=4,
            **launch_options(_combine_splits_kernel, q.device))
    return out




__all__ = ["paged_tree_attention"]
