"""The fused per-layer Triton kernels equal kernels/reference.py (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from treespec.kernels import reference as ref
from triton_interpret import DEV, HAVE_TRITON, load as _load, needs_triton

pytestmark = needs_triton

if HAVE_TRITON:
    _load("treespec.kernels.triton_common")
    fused = _load("treespec.kernels.triton_fused")


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g).to(dtype).to(DEV)
    r = torch.randn(5, 48, generator=g).to(dtype).to(DEV) if with_residual else None
    w = torch.randn(48, generator=g).to(dtype).to(DEV)
    out, total = fused.add_rms_norm(x, r, w, 1e-6)
    want, want_total = ref.add_rms_norm(x, r, w, 1e-6)
    close(out, want, dtype)
    close(total, want_total, dtype)


@pytest.mark.parametrize("norms", [True, False], ids=["qwen3", "eagle3-no-norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_write(dtype, norms):
    g = torch.Generator().manual_seed(1)
    t, hq, hkv, d, nb, bs = 4, 4, 2, 16, 6, 4
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEV)
    qn, kn = (torch.randn(d, generator=g).to(dtype).to(DEV) if norms else None
              for _ in range(2))
    pos = torch.tensor([0, 7, 3, 100], device=DEV)
    inv = (1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float().to(DEV)
    slots = torch.tensor([5, 0, 17, 9], device=DEV)
    caches = [torch.zeros(nb, bs, hkv, d, dtype=dtype, device=DEV) for _ in range(4)]
    q = fused.qk_norm_rope_write(qkv, qn, kn, pos, inv, caches[0], caches[1], slots, hq, hkv, 1e-6)
    q_ref = ref.qk_norm_rope_write(qkv, qn, kn, pos, inv, caches[2], caches[3], slots, hq, hkv,
                                   1e-6)
    close(q, q_ref, dtype)
    close(caches[0], caches[2], dtype)
    close(caches[1], caches[3], dtype)
    assert caches[1].abs().sum() > 0
    if not norms:       # rotation alone keeps each head's norm
        heads = qkv[:, :hq * d].float().view(t, hq, d).norm(dim=-1)
        torch.testing.assert_close(q.float().norm(dim=-1), heads, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    x = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEV)
    close(fused.silu_mul(x), ref.silu_mul(x), dtype)


def test_launchers_refuse_bad_shapes():
    x = torch.randn(3, 8).to(DEV)        # no CUDA RNG: the GPU run captures graphs before
    with pytest.raises(ValueError, match="weight"):
        fused.add_rms_norm(x, None, torch.ones(7, device=DEV), 1e-6)
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        fused.silu_mul(torch.randn(3, 7, device=DEV))


def test_whole_model_on_triton_kernels_equals_reference(target_dir):
    """Every kernel of the backend at once: a prefill and a tree verify forward."""
    from treespec.common.runtime.forward_batch import Chunk, build_forward_batch, chain_chunk
    from treespec.common.runtime.kv_cache import SeqPages
    from treespec.common.model.qwen3 import Qwen3Model
    from treespec.common.spec.tree import verify_chunk_layout

    for name in ("treespec.kernels.triton_kv", "treespec.kernels.triton_accept", "treespec.kernels.triton_tree_attention"):
        _load(name)
    backend = _load("treespec.kernels.triton_backend")
    model = Qwen3Model.from_pretrained(target_dir, device=DEV)
    outs = []
    for ops in (ref, backend):
        cache = model.new_cache(16, 4)
        seq = SeqPages()
        prompt = [1, 5, 9, 13, 2, 7, 1, 5]
        fb = build_forward_batch([chain_chunk(seq, prompt)], cache)
        prefill = model.logits(model(fb, cache, ops)[0])
        seq.kv_len = len(prompt)
        parents = torch.tensor([[-1, -1, 0, 2]], dtype=torch.int32)
        cp, dp = verify_chunk_layout(parents)
        fb = build_forward_batch([Chunk(seq, [3, 4, 6, 8, 9], cp[0].tolist(), dp[0].tolist())],
                                 cache)
        outs.append((prefill, model.logits(model(fb, cache, ops)[0])))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
