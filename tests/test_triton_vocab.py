"""The vocabulary statistics' kernel (kernels/triton_vocab.py) against
treespec.kernels.reference.vocab_stats: each row's log-sum-exp and its whole chunks' maxima,
over one segment and several, with a partial last chunk and -inf logits. Interpreter on
a CPU, compiled with ``TRITON_INTERPRET=0`` on a GPU."""

from __future__ import annotations

import pytest
import torch

from triton_interpret import DEV, load, needs_triton

from treespec.kernels import reference


def _vocab():
    load("treespec.kernels.triton_common")       # its reductions, decorated with the interpreter on
    return load("treespec.kernels.triton_vocab")


# several rows in one segment, and one row over two segments (the launcher's merge), each
# with a partial last chunk; a dtype each (it changes only the load's conversion)
@needs_triton
@pytest.mark.parametrize("rows, v, dtype", [(3, 4173, torch.float32),
                                            (1, 16384 + 300, torch.bfloat16)])
def test_kernel_gives_the_references_stats(rows, v, dtype):
    tv = _vocab()
    torch.manual_seed(v)
    x = (4 * torch.randn(rows, v + 10)).to(dtype)[:, :v]    # rows v + 10 apart
    x[0, :700] = float("-inf")                              # whole chunks of -inf
    lse, maxima = tv.vocab_stats(x.to(DEV), 128)
    want_lse, want_max = reference.vocab_stats(x, 128)
    assert maxima.shape == (rows, v // 128) and torch.equal(maxima.cpu(), want_max)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-5, atol=1e-5)


@needs_triton
def test_kernel_names_a_bad_argument():
    tv = _vocab()
    with pytest.raises(ValueError, match="logits"):
        tv.vocab_stats(torch.zeros(2, 3, 4, device=DEV), 128)
    with pytest.raises(ValueError, match="chunk"):
        tv.vocab_stats(torch.zeros(2, 300, device=DEV), 100)
