"""A drafter's candidate scores in one kernel (kernels/triton_candidates.py) against
treespec.common.spec.sampling.draft_scores' torch path: greedy, coupled and rejection rows mixed,
top-k / top-p / min-p, a drafter vocabulary of its own (ids). Interpreter on a CPU,
compiled with ``TRITON_INTERPRET=0`` on a GPU."""

from __future__ import annotations

import pytest
import torch

from triton_interpret import DEV, load, needs_triton

from treespec.common.spec.sampling import DRAFT_Q, TOPK_FIRST, draft_scores, filter_draw


def rows(r: int, g: torch.Generator) -> list[torch.Tensor]:
    """[temperature, top_k, top_p, min_p, seed, position] of r rows, a third greedy."""
    t = torch.where(torch.arange(r) % 3 == 0, 0.0, 0.4 + torch.rand(r, generator=g))
    return [t, torch.randint(1, TOPK_FIRST + 1, (r,), generator=g),
            torch.where(torch.rand(r, generator=g) < 0.5, 1.0, 0.5 + 0.5 * torch.rand(r, generator=g)),
            torch.where(torch.rand(r, generator=g) < 0.5, 0.0, 0.1 * torch.rand(r, generator=g)),
            torch.randint(0, 1 << 31, (r,), generator=g), torch.randint(0, 4096, (r,), generator=g)]


@needs_triton
@pytest.mark.parametrize("with_ids", [False, True])
def test_kernel_scores_as_the_torch_path(with_ids, monkeypatch):
    tc = load("treespec.kernels.triton_candidates")
    g = torch.Generator().manual_seed(int(with_ids))
    r, v = 24, 500
    logits = torch.randn(r, v, generator=g) * 3
    params = rows(r, g)
    ids = torch.randperm(4000, generator=g)[:v] if with_ids else None
    for rejection in (torch.zeros(r, dtype=torch.bool), torch.arange(r) % 2 == 1):
        want = draft_scores(logits, *params, rejection, ids=ids, width=TOPK_FIRST)
        lf = logits.float()
        x, cols = (lf / torch.where(params[0] > 0, params[0], 1.0).unsqueeze(-1)).topk(TOPK_FIRST, -1)
        got = tc.score_candidates(*[t.to(DEV) for t in (x, cols, lf.logsumexp(-1), *params,
                                                        rejection)], DRAFT_Q,
                                  None if ids is None else ids.to(DEV))
        got = [t.cpu() for t in got]
        assert torch.equal(got[2], want[2])
        for a, b in zip(got[:2], want[:2]):
            assert torch.equal(a.isinf(), b.isinf())
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[4], want[4], atol=1e-5, rtol=1e-5)
        live = want[4] > 0
        assert torch.equal(got[3][live], want[3][live]) and live.any() == rejection.any()
        # the first pick: the token drawn (the same wherever no two picks nearly tie)
        assert torch.equal(got[1].argmax(-1), want[1].argmax(-1))


@needs_triton
def test_draw_kernel_filters_and_draws_as_the_torch_path():
    tc = load("treespec.kernels.triton_candidates")
    g = torch.Generator().manual_seed(5)
    r, v = 40, 700
    logits = torch.randn(r, v, generator=g) * 3
    params = rows(r, g)
    vals, ids, tokens = filter_draw(logits, *params, width=TOPK_FIRST)
    x, cols = (logits / torch.where(params[0] > 0, params[0], 1.0).unsqueeze(-1)).topk(TOPK_FIRST, -1)
    got = [t.cpu() for t in tc.filter_draw(*[t.to(DEV) for t in (x, cols, *params)])]
    assert torch.equal(got[1], ids) and torch.equal(got[0].isinf(), vals.isinf())
    torch.testing.assert_close(got[0], vals)
    drawing = params[0] > 0
    assert torch.equal(got[2][drawing], tokens[drawing]) and (got[2][~drawing] == -1).all()
    assert torch.equal(tokens[~drawing], logits[~drawing].argmax(-1))


@pytest.mark.skipif(DEV.type != "cuda", reason="the GPU path: CUDA, Triton compiled")
def test_gpu_sampling_entry_points_give_the_torch_paths_result():
    """On a GPU, draft_scores and filter_draw take a whole vocabulary's top W from
    treespec.common.spec.vocab_top (chunk maxima and log-sum-exp from treespec.kernels.vocab_stats), then the
    kernels above: the CPU's torch path's columns, values and draws."""
    g = torch.Generator().manual_seed(7)
    r, v = 24, 151936
    logits = torch.randn(r, v, generator=g) * 3
    params = rows(r, g)
    on = [p.to(DEV) for p in params]
    vals, ids, tokens = filter_draw(logits, *params, width=TOPK_FIRST)
    got = [t.cpu() for t in filter_draw(logits.to(DEV), *on, width=TOPK_FIRST)]
    assert torch.equal(got[1], ids) and torch.equal(got[2], tokens)
    torch.testing.assert_close(got[0], vals)
    rejection = torch.arange(r) % 2 == 1
    want = draft_scores(logits, *params, rejection, width=TOPK_FIRST)
    got = [t.cpu() for t in draft_scores(logits.to(DEV), *on, rejection.to(DEV),
                                         width=TOPK_FIRST)]
    assert torch.equal(got[2], want[2])
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a.isinf(), b.isinf())
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[4], want[4], atol=1e-5, rtol=1e-5)
