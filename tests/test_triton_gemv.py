"""The skinny-linear Triton kernels equal torch's linear (+ reference silu_mul), and a
row's output does not depend on how many rows came with it (interpreter on CPU)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from treespec.kernels import reference as ref
from triton_interpret import DEV, HAVE_TRITON, load as _load, needs_triton

pytestmark = needs_triton

if HAVE_TRITON:
    _load("treespec.kernels.triton_common")
    gemv = _load("treespec.kernels.triton_gemv")

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


def _numpy_matmul_rounds_rows_by_place() -> bool:
    """Whether this numpy's matmul gives a row different bits at another place in the
    same tile shape (its BLAS's micro-kernels may): under the interpreter tl.dot is
    numpy's matmul, so the kernel cannot be held to row invariance there."""
    import numpy as np
    g = np.random.default_rng(4)
    a, b = g.standard_normal((16, 64), np.float32), g.standard_normal((64, 16), np.float32)
    moved = np.zeros_like(a)
    moved[0] = a[6]
    return not np.array_equal(np.matmul(a, b)[6], np.matmul(moved, b)[0])


@pytest.mark.skipif(DEV.type != "cuda" and _numpy_matmul_rounds_rows_by_place(),
                    reason="the interpreter's tl.dot (numpy's matmul) rounds a row by its "
                           "place in the tile on this machine")
def test_row_does_not_depend_on_row_count():
    """Within a row class (here up to 16 rows) a row's output is the same alone."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 200, generator=g).to(DEV)
    w = torch.randn(48, 200, generator=g).to(DEV)
    many = gemv.linear(x, w, SMALL)
    for i in range(7):
        assert torch.equal(gemv.linear(x[i:i + 1], w, SMALL)[0], many[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("silu", [False, True])
def test_invariant_mode_gives_a_row_the_same_bits_at_any_row_count(dtype, silu):
    """Invariant mode: a row alone, among 5, 16, 17, 40 and 150 rows (past 16: no GEMM
    library, more row tiles; at 150 more than one group of GROUP_M row tiles) at several
    places, bit for bit; the default mode's past-16 path (torch here, cuBLAS on a GPU) is
    a different K order."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(150, 200, generator=g).to(dtype).to(DEV)
    w = (torch.randn(2 * 48 if silu else 48, 200, generator=g) * 0.1).to(dtype).to(DEV)
    run = gemv.linear_silu_mul if silu else gemv.linear
    cfg = (16, *SMALL)
    alone = [run(x[i:i + 1], w, cfg, invariant=True)[0] for i in (0, 3, 16, 39)]
    for m in (5, 16, 17, 40, 150):
        rows = torch.randperm(150, generator=g)[:m]
        places = (0, m // 2, m - 1, 1)           # first, middle, last, second
        rows[list(places)] = torch.tensor([0, 3, 16, 39])
        many = run(x[rows], w, cfg, invariant=True)
        for want, at in zip(alone, places):
            assert torch.equal(many[at], want), (m, at)
    assert rel_err(gemv.linear(x, w, cfg, invariant=True) if not silu else
                   gemv.linear_silu_mul(x, w, cfg, invariant=True),
                   F.linear(x.float(), w.float()) if not silu else
                   ref.silu_mul(F.linear(x.float(), w.float()))) < (1e-5 if dtype == torch.float32
                                                                    else 2e-2)


def test_invariant_config_takes_the_bucket_of_the_row_count(monkeypatch):
    """The tuned table's buckets by max rows; past the last, the last; an untuned product
    or a CPU device: the 16-row tile."""
    table = {"48,200,0": [(5, (16, 32, 128, 4, 4)), (40, (64, 64, 64, 4, 3)),
                          (320, (128, 64, 64, 4, 3))]}
    monkeypatch.setattr(gemv, "_invariant_table", lambda name, arch: table)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    cuda = torch.device("cuda")
    got = [gemv.invariant_config(48, 200, False, cuda, m)[0] for m in (1, 5, 6, 40, 41, 4160)]
    assert got == [16, 16, 64, 64, 128, 128]
    assert gemv.invariant_config(64, 200, False, cuda, 40)[0] == 16
    assert gemv.invariant_config(48, 200, False, torch.device("cpu"), 40)[0] == 16


def test_an_untuned_gpu_takes_its_architecture_s_table(monkeypatch, tmp_path):
    """A GPU not in the file uses the table its architecture names (the same configs
    compile to the same code there); another architecture gets none."""
    f = tmp_path / "configs.json"
    f.write_text(json.dumps({"GPU A": {"48,200,0": [[5, 16, 32, 128, 4, 4]]},
                             "sm_90": "GPU A"}))
    monkeypatch.setattr(gemv, "INVARIANT_CONFIGS", f)
    gemv._invariant_table.cache_clear()
    try:
        assert gemv._invariant_table("GPU A", "sm_80")["48,200,0"] == [(5, (16, 32, 128, 4, 4))]
        assert gemv._invariant_table("GPU B", "sm_90") == gemv._invariant_table("GPU A", "sm_80")
        assert gemv._invariant_table("GPU B", "sm_80") == {}
    finally:
        gemv._invariant_table.cache_clear()
    shipped = json.loads(gemv.INVARIANT_CONFIGS.read_text())
    assert shipped["sm_90"] in shipped          # the H200 takes the H100's table


def test_invariant_backend_routes_every_linear_to_the_kernel(monkeypatch):
    inv = _load("treespec.kernels.triton_invariant")
    seen = []
    real = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda *a, **k: seen.append(a[0].shape[0]) or real(*a, **k))
    x = torch.randn(3, 20, 32, device=DEV)          # 60 rows, fp32: the default goes to torch
    w, b = torch.randn(24, 32, device=DEV), torch.randn(24, device=DEV)
    y = inv.linear(x, w, b)
    assert seen == [60] and y.shape == (3, 20, 24)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    from treespec.kernels.dispatch import select
    assert select(torch.device("cpu"), "invariant").__name__ == "treespec.kernels.reference"


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
    common = _load("treespec.kernels.triton_common")
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


def test_pdl_only_where_the_device_and_triton_have_it():
    common = _load("treespec.kernels.triton_common")
    assert not common.pdl_supported(torch.device("cpu"))
    if DEV.type == "cpu":       # interpreted kernels take no launch options
        assert common.launch_options(gemv._gemv_kernel, DEV) == {"PDL": False}
