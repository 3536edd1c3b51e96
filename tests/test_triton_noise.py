"""The noise hash's kernel (kernels/triton_noise.py) against kernels/noise.py: the same
bits for ids given as a count, one list, or a list a row, at seeds, positions and ids
up to their ranges. Interpreter on a CPU, compiled with ``TRITON_INTERPRET=0`` on a GPU."""

from __future__ import annotations

import pytest
import torch

from triton_interpret import DEV, load, needs_triton

from treespec.kernels import noise


@needs_triton
@pytest.mark.parametrize("rows, v", [(1, 1), (5, 37), (3, 2051)])
def test_kernel_draws_the_references_bits(rows, v):
    tn = load("treespec.kernels.triton_noise")
    g = torch.Generator().manual_seed(rows * 1000 + v)
    seed = torch.randint(0, 1 << 31, (rows,), generator=g)
    seed[0] = (1 << 31) - 1
    seed ^= noise.BONUS_SALT                      # salted keys reach 2^32 - 1
    position = torch.randint(0, 1 << 20, (rows,), generator=g, dtype=torch.int32)
    per_row = torch.randint(0, 152_000, (rows, 2 * v), generator=g)[:, ::2]  # a strided view
    for ids in (v, torch.randperm(v, generator=g), per_row):
        args = [x.to(DEV) if isinstance(x, torch.Tensor) else x for x in (seed, position, ids)]
        got = tn.uniform_noise(*args).cpu()
        want = noise.uniform_noise(seed, position, ids)
        assert got.dtype == want.dtype == torch.float32 and got.shape == (rows, v)
        assert torch.equal(got, want)


@needs_triton
def test_kernel_names_a_bad_argument():
    tn = load("treespec.kernels.triton_noise")
    seed = torch.zeros(3, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="position"):
        tn.uniform_noise(seed, torch.zeros(2, dtype=torch.int64, device=DEV), 4)
    with pytest.raises(ValueError, match="ids"):
        tn.uniform_noise(seed, seed, torch.zeros(3, 4, device=DEV))
