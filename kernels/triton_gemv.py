"""Skinny linears (Triton): y = x @ W.T for a few rows, reading W once, with the
SwiGLU product optionally fused into the epilogue. With its launchers.

A decode or verify step multiplies 1 to 16 rows by each weight matrix, so the
time is the weight read (memory-bound), and a GEMM library's split into a GEMV
plus separate small kernels pays extra launches. Here:

* One program per BN output columns, looping over K in BK tiles. Each tile of W
  ([BN, BK], contiguous along K) is loaded once and multiplied against all rows
  of x ([BM, BK], M padded to the row class BM = 16, 32, 64 or 128) with tl.dot,
  fp32 accumulation, one bf16 rounding at the end: within a row class every
  row's reduction runs in the same order whatever M is, so a row's output does
  not depend on how many rows came with it.
* ``linear_silu_mul`` reads the gate rows [n, n+BN) and the up rows
  [I+n, I+n+BN) of the fused gate_up weight in the same program and writes
  silu(gate) * up, with the same roundings as ``treespec.kernels.reference.silu_mul``
  applied to a bf16 gate_up (so it equals ``silu_mul(linear(x, W))``).

Tile sizes come from ``pick_config`` (measured on an H200 by bench/gemv_probe.py)
and depend on (N, K) and the row class only. Past 16 rows a product goes to the
GEMM library unless a measured config says this kernel wins there
(``supports``).

Batch-invariant mode (``invariant=True``, issue 53): a product's config by M comes from
a tuned table (``invariant_config``) whose configs for that product were all measured to
give each other's bits, so a row's result is the same whatever M is or where the row
sits, and no M goes to the GEMM library (whose kernel, tiles and split-K change with M).
A tile's rows meet only in tl.dot, whose MMA gives each output element its own fixed
reduction (on an H100 tiles of 16-256 rows and BK 64-512 gave each other's bits for all
five of the 8B shape's products). Under the
interpreter tl.dot is numpy's matmul, whose BLAS rounds a row by its place; there each
tile's products are summed in fp64 and rounded once to fp32 (the order then moves a
result only where an fp64 sum lies within 2^-29 of an fp32 rounding boundary).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from treespec.kernels.triton_common import (FLOAT_DTYPES, check_devices, check_dtype, check_shape,
                                   launch_options, pdl_enter)

MAX_ROWS = 128
ROW_CLASSES = (16, 32, 64, 128)


@triton.jit
def _tile_dot(x, w, DOT: tl.constexpr):
    """x [BM, BK] @ w [BN, BK].T in fp32; DOT 0: native, 1: IEEE fp32 (the interpreter's
    tl.dot mishandles bf16), 2: fp64 rounded once (the interpreter, row-invariant)."""
    if DOT == 2:
        return tl.dot(x.to(tl.float64), tl.trans(w.to(tl.float64)),
                      input_precision="ieee").to(tl.float32)
    elif DOT == 1:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(x, tl.trans(w))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, s_xm, s_wn, s_om, UP_OFF,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 SILU: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # programs walk GROUP_M row tiles x every column tile, row tiles fastest: a W tile
    # is read from memory once per group and then from L2 (one row tile: pid = column tile)
    pid = tl.program_id(0)
    num_n = (N + BN - 1) // BN
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    group_m = tl.minimum((M + BM - 1) // BM - first_m, GROUP_M)
    in_group = pid % (GROUP_M * num_n)
    rn = (in_group // group_m) * BN + tl.arange(0, BN)
    rm = (first_m + in_group % group_m) * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    nmask = rn < N
    mmask = rm < M
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    acc_u = tl.full((BM, BN), 0.0, dtype=tl.float32)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * s_wn
    for k0 in range(0, K, BK):
        kk = k0 + rk
        kmask = kk < K
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * s_xm + kk[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        wmask = nmask[:, None] & kmask[None, :]
        w = tl.load(w_rows + kk[None, :], mask=wmask, other=0.0)
        acc += _tile_dot(x, w, DOT)
        if SILU:
            u = tl.load(w_rows + UP_OFF * s_wn + kk[None, :], mask=wmask, other=0.0)
            acc_u += _tile_dot(x, u, DOT)
    dt = out_ptr.dtype.element_ty
    if SILU:        # round gate and up as a bf16 GEMM would, then silu_mul's roundings
        g = acc.to(dt).to(tl.float32)
        up = acc_u.to(dt).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        res = (silu * up).to(dt)
    else:
        res = acc.to(dt)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * s_om + rn[None, :], res,
             mask=mmask[:, None] & nmask[None, :])


# (BN, BK, num_warps, num_stages) by (output columns, K, fused SwiGLU, row class): the
# fastest of bench/gemv_probe.py's sweep on an H200 at the Qwen3-8B projections (the same tiles
# won at 1, 5 and 16 rows, bench/NOTES.md); the default was within 6 % of the best
# at every one of them.
DEFAULT_CONFIG = (32, 256, 4, 4)
CONFIGS: dict[tuple[int, int, bool, int], tuple[int, int, int, int]] = {
    (6144, 4096, False, 16): (64, 256, 4, 4),       # qkv
    (4096, 4096, False, 16): (32, 512, 4, 4),       # o_proj
    (12288, 4096, True, 16): (32, 128, 4, 4),       # gate_up + SwiGLU
    (4096, 12288, False, 16): (32, 512, 4, 4),      # down
    (151936, 4096, False, 16): (64, 512, 4, 2),     # lm_head
    # the Qwen3-0.6B draft model's narrow projections and LM head, EAGLE-3's LM head
    # (bench/results/gemv_probe_drafters_h200_s15.json; the rest won with the default)
    (1024, 2048, False, 16): (16, 512, 4, 4),       # o_proj
    (1024, 3072, False, 16): (16, 512, 4, 4),       # down
    (151936, 1024, False, 16): (64, 512, 4, 2),     # lm_head
    (32000, 4096, False, 16): (64, 512, 4, 2),      # EAGLE-3 lm_head (draft vocabulary)
}


def row_class(m: int) -> int:
    return next(c for c in ROW_CLASSES if m <= c)


def supports(m: int, n: int, k: int, silu: bool) -> bool:
    """Whether this kernel is the one to use for m rows: always up to 16, past that
    only where a measured config exists."""
    return 0 < m <= 16 or (m <= MAX_ROWS and (n, k, silu, row_class(m)) in CONFIGS)


def pick_config(n: int, k: int, silu: bool, bm: int = 16) -> tuple[int, int, int, int]:
    return CONFIGS.get((n, k, silu, bm), DEFAULT_CONFIG if bm == 16 else (32, 64, 4, 3))


GROUP_M = 8
# The invariant mode's configs by GPU name and "N,K,silu" (0/1): per product, buckets
# [max_rows, BM, BN, BK, num_warps, num_stages] by ascending max_rows (the last serves
# every M past it too). A row keeps its bits across buckets only because each product's
# configs were measured on that GPU to give each other's bits at every M
# (bench/invariant_gemm_probe.py writes buckets of one such class only). A GPU not named
# there takes the table its architecture names ("sm_90": a name): the same configs
# compile to the same code for one architecture, so they keep the same bits. Elsewhere:
# one config, 16-row tiles with the 16-row class's tile.
INVARIANT_CONFIGS = Path(__file__).with_name("invariant_gemm_configs.json")


@functools.cache
def _invariant_table(device_name: str, arch: str) -> dict[str, list[tuple[int, tuple[int, ...]]]]:
    if not INVARIANT_CONFIGS.exists():
        return {}
    tables = json.loads(INVARIANT_CONFIGS.read_text())
    table = tables.get(device_name) or tables.get(tables.get(arch, ""), {})
    return {key: [(b[0], tuple(b[1:])) for b in buckets] for key, buckets in table.items()}


def _device_table(device: torch.device) -> dict[str, list[tuple[int, tuple[int, ...]]]]:
    arch = "sm_{}{}".format(*torch.cuda.get_device_capability(device))
    return _invariant_table(torch.cuda.get_device_name(device), arch)


def invariant_tuned(device: torch.device) -> bool:
    """Whether the invariant GEMM has tuned buckets for this CUDA device."""
    return bool(_device_table(device))


def invariant_config(n: int, k: int, silu: bool, device: torch.device, m: int
                     ) -> tuple[int, int, int, int, int]:
    if device.type == "cuda":
        buckets = _device_table(device).get(f"{n},{k},{int(silu)}")
        if buckets:
            return next((cfg for top, cfg in buckets if m <= top), buckets[-1][1])
    return (ROW_CLASSES[0], *pick_config(n, k, silu, ROW_CLASSES[0]))


def _launch(x: torch.Tensor, w: torch.Tensor, n_out: int, silu: bool,
            config: tuple[int, ...] | None, where: str,
            invariant: bool = False) -> torch.Tensor:
    check_devices(_gemv_kernel, where, x=x, weight=w)
    check_dtype(where, "x", x, FLOAT_DTYPES)
    check_shape(where, "x", x, (None, None))
    m, k = x.shape
    check_shape(where, "weight", w, (None, k))
    if w.dtype != x.dtype:
        raise ValueError(f"{where}: weight dtype {w.dtype} != x dtype {x.dtype}")
    if m > MAX_ROWS and not invariant:
        raise ValueError(f"{where}: at most {MAX_ROWS} rows, got {m}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{where}: x and weight rows must be contiguous")
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if invariant:
        bm, bn, bk, warps, stages = config or invariant_config(n_out, k, silu, x.device, m)
    else:
        bm = row_class(m)
        bn, bk, warps, stages = config or pick_config(n_out, k, silu, bm)
    interp = x.device.type != "cuda"
    dot = (2 if invariant else 1) if interp else 1 if x.dtype == torch.float32 else 0
    _gemv_kernel[(triton.cdiv(n_out, bn) * triton.cdiv(m, bm),)](
        x, w, out, m, n_out, k, x.stride(0), w.stride(0), out.stride(0), n_out if silu else 0,
        BM=bm, BN=bn, BK=bk, GROUP_M=GROUP_M, SILU=silu, DOT=dot,
        num_warps=warps, num_stages=stages, **launch_options(_gemv_kernel, x.device))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor,
           config: tuple[int, ...] | None = None, *,
           invariant: bool = False) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype; M <= 128 unless invariant (one
    K order for every M: see the module's docstring). config: (BN, BK, warps, stages),
    invariant: (BM, BN, BK, warps, stages)."""
    return _launch(x, weight, weight.shape[0], False, config, "linear", invariant)


def linear_silu_mul(x: torch.Tensor, gate_up: torch.Tensor,
                    config: tuple[int, ...] | None = None, *,
                    invariant: bool = False) -> torch.Tensor:
    """silu_mul(linear(x, gate_up)): x [M, K], gate_up [2I, K] -> [M, I]; M as linear's."""
    if gate_up.dim() != 2 or gate_up.shape[0] % 2:
        raise ValueError(f"linear_silu_mul: gate_up must be [2I, K], got {tuple(gate_up.shape)}")
    return _launch(x, gate_up, gate_up.shape[0] // 2, True, config, "linear_silu_mul",
                   invariant)
