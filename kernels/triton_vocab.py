"""treespec.kernels.reference.vocab_stats on the device (Triton): each row's log-sum-exp and its
chunks' maxima in one read of the logits, where log_softmax would write a whole
log-probability tensor. A program takes a segment of chunk x BLOCK_CHUNKS x ITERATIONS
columns of a row (so that a few rows still fill the device) and keeps an online maximum
and sum of exponentials per lane; the launcher merges the segments."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treespec.kernels.triton_common import (FLOAT_DTYPES, check_devices, check_dtype, check_unit_last,
                                   vmax, vsum)

BLOCK_CHUNKS = 8            # chunks a loop iteration loads
ITERATIONS = 16             # iterations a program runs: its segment's length in blocks


@triton.jit
def _stats_kernel(x_ptr, seg_max_ptr, seg_sum_ptr, chunk_max_ptr, v, x_row_stride,
                  num_chunks, num_segments,
                  CHUNK: tl.constexpr, NC: tl.constexpr, ITERS: tl.constexpr):
    r = tl.program_id(0)
    seg = tl.program_id(1)
    ci = tl.arange(0, NC)
    co = tl.arange(0, CHUNK)
    m = tl.full((NC,), float("-inf"), tl.float32)       # per lane: running max, sum of exp
    s = tl.full((NC,), 0.0, tl.float32)
    for it in range(ITERS):
        chunk = (seg * ITERS + it) * NC + ci                                  # [NC]
        cols = chunk[:, None] * CHUNK + co[None, :]                           # [NC, CHUNK]
        x = tl.load(x_ptr + r * x_row_stride + cols, mask=cols < v,
                    other=float("-inf")).to(tl.float32)
        cm = vmax(x, 1)                                                       # [NC]
        tl.store(chunk_max_ptr + r * num_chunks + chunk, cm, mask=chunk < num_chunks)
        new = tl.maximum(m, cm)
        safe = tl.where(new == float("-inf"), 0.0, new)   # nothing finite yet: sums stay 0
        s = s * tl.exp(m - safe) + vsum(tl.exp(x - safe[:, None]), 1)
        m = new
    top = vmax(m, 0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    tl.store(seg_max_ptr + r * num_segments + seg, top)
    tl.store(seg_sum_ptr + r * num_segments + seg, vsum(s * tl.exp(m - safe_top), 0))


def vocab_stats(logits: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """See treespec.kernels.reference.vocab_stats."""
    where = "vocab_stats"
    if logits.dim() != 2:
        raise ValueError(f"{where}: logits must be [rows, vocab], "
                         f"got shape {tuple(logits.shape)}")
    check_dtype(where, "logits", logits, FLOAT_DTYPES)
    check_unit_last(where, "logits", logits)
    check_devices(_stats_kernel, where, logits=logits)
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"{where}: chunk must be a power of two, got {chunk}")
    r, v = logits.shape
    c = v // chunk
    segment = chunk * BLOCK_CHUNKS * ITERATIONS
    n = triton.cdiv(v, segment)
    dev = logits.device
    seg_max = torch.empty(r, n, dtype=torch.float32, device=dev)
    seg_sum = torch.empty(r, n, dtype=torch.float32, device=dev)
    maxima = torch.empty(r, c, dtype=torch.float32, device=dev)
    if r and v:
        _stats_kernel[(r, n)](logits, seg_max, seg_sum, maxima, v, logits.stride(0), c, n,
                              CHUNK=chunk, NC=BLOCK_CHUNKS, ITERS=ITERATIONS, num_warps=4)
    top = seg_max.amax(1, keepdim=True)
    lse = (top + (seg_sum * (seg_max - top).exp()).sum(1, keepdim=True).log()).squeeze(1)
    return lse, maxima
