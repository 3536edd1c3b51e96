"""The per-layer fused kernels (Triton), with their launchers: one kernel each for
residual add + RMSNorm, q/k RMSNorm + RoPE + KV write, and SiLU(gate) * up.

Semantics are treespec.kernels.reference's ``add_rms_norm``, ``qk_norm_rope_write`` and
``silu_mul`` (which the tests hold them to). Inside a CUDA graph each small
kernel costs a few microseconds whatever it does, so a decoder layer here has
four of them besides its four GEMMs and attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treespec.kernels.triton_common import (FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_dtype,
                                   check_shape, launch_options, next_pow2, pdl_enter, vsum)


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, n, eps,
                         s_x, s_r, s_o, s_ro, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + row * s_x + cols, mask=m, other=0.0)
    if HAS_RES:     # add in fp32, round once: what torch does for bf16 too
        r = tl.load(r_ptr + row * s_r + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(rout_ptr + row * s_ro + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(vsum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + cols, (xf * inv * w).to(x.dtype), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return add_rms_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """See treespec.kernels.reference.add_rms_norm. x, residual [T, H]; weight [H]."""
    where = "add_rms_norm"
    tensors = dict(x=x, weight=weight) if residual is None else dict(x=x, residual=residual,
                                                                     weight=weight)
    check_devices(_add_rms_norm_kernel, where, **tensors)
    check_dtype(where, "x", x, FLOAT_DTYPES)
    check_shape(where, "x", x, (None, None))
    t, h = x.shape
    check_shape(where, "weight", weight, (h,))
    if residual is not None:
        check_shape(where, "residual", residual, (t, h))
        if residual.dtype != x.dtype:
            raise ValueError(f"{where}: residual dtype {residual.dtype} != x dtype {x.dtype}")
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError(f"{where}: rows must be contiguous")
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    if t == 0:
        return out, total
    r = residual if residual is not None else x
    block = next_pow2(h)
    _add_rms_norm_kernel[(t,)](x, r, weight, out, total, h, eps, x.stride(0), r.stride(0),
                               out.stride(0), total.stride(0), HAS_RES=residual is not None,
                               BLOCK=block, num_warps=4 if block <= 2048 else 8,
                               **launch_options(_add_rms_norm_kernel, x.device))
    return out, total


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, qn_ptr, kn_ptr, pos_ptr, freq_ptr, kc_ptr, vc_ptr, slot_ptr,
                         q_out_ptr, s_qkv, s_qt, s_qh, s_kcs, s_kch, s_vcs, s_vch, eps,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                         NORM: tl.constexpr, PDL: tl.constexpr):
    """Program (token, head): q heads 0..HQ-1, then kv heads (k normed + rotated, v copied)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half = tl.arange(0, D // 2)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    freq = pos * tl.load(freq_ptr + half)
    cos, sin = tl.cos(freq), tl.sin(freq)
    is_q = h < HQ
    base = tl.where(is_q, h * D, HQ * D + (h - HQ) * D)
    x1 = tl.load(qkv_ptr + t * s_qkv + base + half)
    x2 = tl.load(qkv_ptr + t * s_qkv + base + D // 2 + half)
    dt = x1.dtype
    n1, n2 = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        inv = 1.0 / tl.sqrt((vsum(n1 * n1, 0) + vsum(n2 * n2, 0)) / D + eps)
        if is_q:
            w1 = tl.load(qn_ptr + half).to(tl.float32)
            w2 = tl.load(qn_ptr + D // 2 + half).to(tl.float32)
        else:
            w1 = tl.load(kn_ptr + half).to(tl.float32)
            w2 = tl.load(kn_ptr + D // 2 + half).to(tl.float32)
        n1 = (n1 * inv * w1).to(dt).to(tl.float32)      # the reference rounds after the norm
        n2 = (n2 * inv * w2).to(dt).to(tl.float32)
    o1 = (n1 * cos - n2 * sin).to(dt)
    o2 = (n2 * cos + n1 * sin).to(dt)
    if is_q:
        q_row = q_out_ptr + t * s_qt + h * s_qh
        tl.store(q_row + half, o1)
        tl.store(q_row + D // 2 + half, o2)
    else:
        kh = h - HQ
        slot = tl.load(slot_ptr + t).to(tl.int64)
        k_row = kc_ptr + slot * s_kcs + kh * s_kch
        tl.store(k_row + half, o1.to(kc_ptr.dtype.element_ty))
        tl.store(k_row + D // 2 + half, o2.to(kc_ptr.dtype.element_ty))
        vbase = HQ * D + HKV * D + kh * D
        full = tl.arange(0, D)
        v = tl.load(qkv_ptr + t * s_qkv + vbase + full)
        tl.store(vc_ptr + slot * s_vcs + kh * s_vch + full, v.to(vc_ptr.dtype.element_ty))


def qk_norm_rope_write(qkv: torch.Tensor, q_norm: torch.Tensor | None,
                       k_norm: torch.Tensor | None, positions: torch.Tensor,
                       inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float
                       ) -> torch.Tensor:
    """See treespec.kernels.reference.qk_norm_rope_write. One program per (token, q or kv head)."""
    where = "qk_norm_rope_write"
    norms = {} if q_norm is None else dict(q_norm=q_norm, k_norm=k_norm)
    check_devices(_qk_norm_rope_kernel, where, qkv=qkv, positions=positions,
                  inv_freq=inv_freq, k_cache=k_cache, v_cache=v_cache, slots=slots, **norms)
    check_dtype(where, "qkv", qkv, FLOAT_DTYPES)
    check_dtype(where, "positions", positions, INDEX_DTYPES)
    check_dtype(where, "slots", slots, INDEX_DTYPES)
    d = 2 * inv_freq.shape[0]
    if d < 2 or d & (d - 1):
        raise ValueError(f"{where}: head_dim must be a power of two, got {d}")
    t = qkv.shape[0]
    check_shape(where, "qkv", qkv, (t, (num_heads + 2 * num_kv_heads) * d))
    for name, w in norms.items():
        check_shape(where, name, w, (d,))
    check_shape(where, "inv_freq", inv_freq, (d // 2,))
    check_shape(where, "positions", positions, (t,))
    check_shape(where, "slots", slots, (t,))
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_shape(where, name, c, (None, None, num_kv_heads, d))
        if c.stride(3) != 1 or c.stride(1) != num_kv_heads * d:
            raise ValueError(f"{where}: {name} slots must be dense [kv_heads, head_dim] rows")
    if qkv.stride(1) != 1 or inv_freq.dtype != torch.float32:
        raise ValueError(f"{where}: qkv rows must be contiguous and inv_freq float32")
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    _qk_norm_rope_kernel[(t, num_heads + num_kv_heads)](
        qkv, q_norm if norms else qkv, k_norm if norms else qkv, positions,
        inv_freq.contiguous(), k_cache, v_cache, slots, q,
        qkv.stride(0), q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2), eps, HQ=num_heads, HKV=num_kv_heads, D=d,
        NORM=bool(norms), num_warps=1 if d <= 64 else 2,
        **launch_options(_qk_norm_rope_kernel, qkv.device))
    return q


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, s_x, s_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(x_ptr + row * s_x + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * s_x + n + cols, mask=m, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32)   # torch rounds silu first
    tl.store(out_ptr + row * s_o + cols, (silu * u.to(tl.float32)).to(u.dtype), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See treespec.kernels.reference.silu_mul. gate_up [T, 2I] -> [T, I]."""
    where = "silu_mul"
    check_devices(_silu_mul_kernel, where, gate_up=gate_up)
    check_dtype(where, "gate_up", gate_up, FLOAT_DTYPES)
    check_shape(where, "gate_up", gate_up, (None, None))
    t, two_i = gate_up.shape
    if two_i % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"{where}: gate_up must be [T, 2I] with contiguous rows")
    n = two_i // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, next_pow2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0),
                                                 out.stride(0), BLOCK=block, num_warps=4,
                                                 **launch_options(_silu_mul_kernel, gate_up.device))
    return out
