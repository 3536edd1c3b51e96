"""The Triton backend's row-wise kernels (norms, RoPE with the KV write, SiLU, the
vocabulary statistics behind argmax and sampling) give a row the same bits alone as among
k rows, at its first, middle and last place (issue 53: with the invariant GEMMs and
attention, a verify row is a decode row bit for bit). Interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from triton_interpret import DEV, HAVE_TRITON, load as _load, needs_triton

pytestmark = needs_triton

if HAVE_TRITON:
    _load("treespec.kernels.triton_common")
    fused = _load("treespec.kernels.triton_fused")
    vocab = _load("treespec.kernels.triton_vocab")

ROWS = 7
PLACES = (0, ROWS // 2, ROWS - 1)


def alone_and_among(fn, *rows: torch.Tensor) -> None:
    """fn(*tensors) -> tuple of [rows, ...] outputs: each place's row alone == among all."""
    among = fn(*rows)
    for i in PLACES:
        alone = fn(*(t[i:i + 1] for t in rows))
        for a, b in zip(alone, among):
            assert torch.equal(a[0], b[i]), (fn, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_silu_and_vocab_stats(dtype):
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(ROWS, 96, generator=g).to(DEV, dtype) for _ in range(2))
    w = torch.randn(96, generator=g).to(DEV, dtype)
    alone_and_among(lambda a: (fused.rms_norm(a, w, 1e-6),), x)
    alone_and_among(lambda a, r: fused.add_rms_norm(a, r, w, 1e-6), x, res)
    alone_and_among(lambda a: (fused.silu_mul(a),), x)
    logits = torch.randn(ROWS, 1000, generator=g).to(DEV, dtype)
    alone_and_among(lambda a: vocab.vocab_stats(a, 64), logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_and_the_kv_it_writes(dtype):
    hq, hkv, d, bs = 4, 2, 32, 16
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(ROWS, (hq + 2 * hkv) * d, generator=g).to(DEV, dtype)
    qn, kn = (torch.randn(d, generator=g).to(DEV, dtype) for _ in range(2))
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)).to(DEV)
    positions = torch.tensor([3, 900, 17, 5, 64, 2000, 40], device=DEV)
    slots = torch.arange(ROWS, device=DEV) * 3

    def run(qkv_rows, pos, slot):
        kc = torch.zeros(4, bs, hkv, d, dtype=dtype, device=DEV)
        vc = torch.zeros_like(kc)
        q = fused.qk_norm_rope_write(qkv_rows, qn, kn, pos, inv_freq, kc, vc, slot, hq, hkv,
                                     1e-6)
        flat = slot.long()
        return q, kc.view(-1, hkv, d)[flat], vc.view(-1, hkv, d)[flat]

    alone_and_among(run, qkv, positions, slots)
