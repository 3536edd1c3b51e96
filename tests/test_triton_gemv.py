"""The skinny-linear Triton kernels equal torch's linear (+ reference silu_mul), and a
row's output does not depend on how many rows came with it (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ref
from triton_interpret import DEV, HAVE_TRITON, load as _load, needs_triton

pytestmark = needs_triton

if HAVE_TRITON:
    _load("kernels.triton_common")
    gemv = _load("kernels.triton_gemv")

SMALL = (16, 64, 4, 2)      # BN, BK, warps, stages: tiles smaller than the shapes below


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("m,n,k", [(1, 40, 70), (5, 64, 256), (16, 33, 300), (40, 24, 100)])
def test_linear_matches_torch(dtype, tol, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    w = torch.randn(n, k, generator=g).to(dtype).to(DEV)
    want = F.linear(x.float(), w.float())
    assert rel_err(gemv.linear(x, w, SMALL), want) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_linear_silu_mul_matches_reference(dtype, tol):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=g).to(dtype).to(DEV)
    w = torch.randn(2 * 40, 96, generator=g).to(dtype).to(DEV)
    want = ref.silu_mul(F.linear(x.float(), w.float()))
    assert rel_err(gemv.linear_silu_mul(x, w, SMALL), want) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("silu", [False, True])
def test_norm_in_the_first_pass_matches_reference(dtype, tol, with_residual, silu):
    """add_rms_norm then the product, in one kernel: the product, and the new residual
    (x + residual, exactly the reference's), for 1 to 16 rows."""
    g = torch.Generator().manual_seed(5)
    for m in (1, 6):
        x = torch.randn(m, 130, generator=g).to(dtype).to(DEV)
        r = torch.randn(m, 130, generator=g).to(dtype).to(DEV) if with_residual else None
        nw = torch.randn(130, generator=g).to(dtype).to(DEV)
        w = (torch.randn(2 * 24 if silu else 40, 130, generator=g) / 130 ** 0.5).to(dtype).to(DEV)
        got, total = gemv.add_rms_norm_linear(x, r, nw, 1e-6, w, silu, SMALL)
        want, _ = ref.add_rms_norm_linear(x, r, nw, 1e-6, w, silu=silu)      # its roundings
        assert rel_err(got, want) < tol
        torch.testing.assert_close(total, x if r is None else (x.float() + r.float()).to(dtype))
        if m > 1:       # a row alone gives the same bits
            one, _ = gemv.add_rms_norm_linear(x[1:2], None if r is None else r[1:2], nw, 1e-6,
                                              w, silu, SMALL)
            assert torch.equal(one[0], got[1])


def test_row_does_not_depend_on_row_count():
    """Within a row class (here up to 16 rows) a row's output is the same alone."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 200, generator=g).to(DEV)
    w = torch.randn(48, 200, generator=g).to(DEV)
    many = gemv.linear(x, w, SMALL)
    for i in range(7):
        assert torch.equal(gemv.linear(x[i:i + 1], w, SMALL)[0], many[i])


def test_past_16_rows_only_measured_shapes_use_the_kernel():
    assert gemv.supports(16, 1, 1, False) and not gemv.supports(17, 1, 1, False)
    assert not gemv.supports(0, 1, 1, False) and not gemv.supports(129, 4096, 4096, False)
    assert [gemv.row_class(m) for m in (1, 16, 17, 33, 64, 65, 128)] == [16, 16, 32, 64, 64,
                                                                         128, 128]


def test_refuses_bad_arguments():
    x = torch.randn(129, 32, device=DEV)
    w = torch.randn(8, 32, device=DEV)
    with pytest.raises(ValueError, match="at most 128 rows"):
        gemv.linear(x, w)
    with pytest.raises(ValueError, match="weight must have shape"):
        gemv.linear(x[:2], torch.randn(8, 31, device=DEV))
    with pytest.raises(ValueError, match=r"gate_up must be \[2I, K\]"):
        gemv.linear_silu_mul(x[:2], torch.randn(7, 32, device=DEV))
    with pytest.raises(ValueError, match="dtype"):
        gemv.linear(x[:2], w.bfloat16())


@pytest.mark.skipif(DEV.type != "cuda", reason="needs a GPU (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("m", [1, 5, 16])
def test_qwen3_8b_projections_on_gpu(m):
    """Real shapes in bf16, the tuned tiles; replayed inside a CUDA graph with and
    without programmatic dependent launch, on fresh inputs, equal to eager."""
    common = _load("kernels.triton_common")
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, 4096, device=DEV, generator=g).bfloat16()
    w = (torch.randn(6144, 4096, device=DEV, generator=g) * 0.02).bfloat16()
    gu = (torch.randn(2 * 12288, 4096, device=DEV, generator=g) * 0.02).bfloat16()
    want = F.linear(x.float(), w.float())
    assert rel_err(gemv.linear(x, w), want) < 1e-2
    assert rel_err(gemv.linear_silu_mul(x, gu), ref.silu_mul(F.linear(x.float(), gu.float()))) < 2e-2
    for pdl in (False, True):
        common.set_pdl(pdl)
        try:
            gemv.linear_silu_mul(x, gu)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = gemv.linear(gemv.linear_silu_mul(x, gu)[:, :4096].contiguous(), w)
        finally:
            common.set_pdl(None)
        x.copy_(torch.randn(m, 4096, device=DEV, generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemv.linear(gemv.linear_silu_mul(x, gu)[:, :4096].contiguous(), w))
    # the norm in the first pass, as a decoder layer calls it: equal to the two kernels'
    # result up to the RMS's summation order, and a row alone gives the same bits
    fused = _load("kernels.triton_fused")
    r = torch.randn(m, 4096, device=DEV, generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(4096, device=DEV, generator=g)).bfloat16()
    h, total = fused.add_rms_norm(x, r, nw, 1e-6)
    for weight, silu in ((w, False), (gu, True)):
        got, got_total = gemv.add_rms_norm_linear(x, r, nw, 1e-6, weight, silu)
        want = gemv.linear_silu_mul(h, weight) if silu else gemv.linear(h, weight)
        assert torch.equal(got_total, total) and rel_err(got, want) < 1e-2
        alone, _ = gemv.add_rms_norm_linear(x[-1:], r[-1:], nw, 1e-6, weight, silu)
        assert torch.equal(alone[0], got[-1])


def test_pdl_only_where_the_device_and_triton_have_it():
    common = _load("kernels.triton_common")
    assert not common.pdl_supported(torch.device("cpu"))
    if DEV.type == "cpu":       # interpreted kernels take no launch options
        assert common.launch_options(gemv._gemv_kernel, DEV) == {"PDL": False}
