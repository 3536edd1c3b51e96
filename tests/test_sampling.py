"""The sampling pieces: parameters and their checks, the warpers as transformers
defines them, and the counter-based noise."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from treespec.common.serving.errors import InvalidRequest
from treespec.common.spec.sampling import (GREEDY, TOPK_FIRST, SamplingParams, checkpoint_defaults, draw,
                             filter_sparse, filter_width, resolve)
from treespec.common.spec.vocab_top import scaled_top, top_k
from treespec.kernels import reference
from treespec.kernels.noise import gumbel_noise


def filter_logits(logits, temperature, top_k, top_p, min_p, width=-1) -> torch.Tensor:
    """filter_sparse's result as dense logits [R, V] (the filtered-out tokens at -inf)."""
    vals, ids = filter_sparse(logits, temperature, top_k, top_p, min_p, width)
    return torch.full_like(logits, float("-inf")).scatter(-1, ids, vals)


def test_filtering_equals_transformers_warpers():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        logits = torch.randn(1, 50, generator=g) * 3
        t = float(torch.rand(1, generator=g)) * 1.5 + 0.1
        k = int(torch.randint(0, 20, (1,), generator=g))
        p = float(torch.rand(1, generator=g)) * 0.99 + 0.01
        m = float(torch.rand(1, generator=g)) * 0.3
        want = TemperatureLogitsWarper(t)(None, logits.clone())
        for warper, on in ((TopKLogitsWarper(max(k, 1)), k > 0), (TopPLogitsWarper(p), True),
                           (MinPLogitsWarper(m), m > 0)):
            want = warper(None, want) if on else want
        got = filter_logits(logits, torch.tensor([t]), torch.tensor([k]), torch.tensor([p]),
                            torch.tensor([m]))
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        assert torch.allclose(got[~torch.isinf(got)], want[~torch.isinf(want)])
        if k > 0:          # top-k first (a batch whose rows all have top_k <= 24)
            assert torch.equal(filter_logits(logits, torch.tensor([t]), torch.tensor([k]),
                                             torch.tensor([p]), torch.tensor([m]), 24), got)


def test_filter_width_takes_top_k_first_only_when_every_drawing_row_allows_it():
    g, qwen = SamplingParams(), SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
    assert filter_width(None) == filter_width([g, g]) == 0
    assert filter_width([g, qwen]) == TOPK_FIRST
    assert filter_width([qwen, SamplingParams(temperature=1.0)]) == -1         # top_k 0
    assert filter_width([SamplingParams(temperature=1.0, top_k=TOPK_FIRST + 1)]) == -1


def test_noise_is_keyed_by_seed_and_position_only():
    one = gumbel_noise(torch.tensor([7]), torch.tensor([30]), 64)
    batch = gumbel_noise(torch.tensor([3, 7, 7]), torch.tensor([30, 30, 31]), 64)
    assert torch.equal(batch[1:2], one)                  # whatever else is in the batch
    assert not torch.equal(batch[0], batch[1]) and not torch.equal(batch[1], batch[2])
    g = gumbel_noise(torch.arange(1, 201), torch.full((200,), 5), 1000)
    assert abs(g.mean().item() - 0.5772) < 0.02 and abs(g.std().item() - math.pi / 6 ** 0.5) < 0.02


def test_draw_is_greedy_at_temperature_zero_and_keeps_to_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0]]).repeat(500, 1)
    seeds, pos = torch.arange(500), torch.full((500,), 9)

    def run(t: float, k: int) -> torch.Tensor:
        n = logits.shape[0]
        return draw(logits, torch.full((n,), t), torch.full((n,), k), torch.ones(n),
                    torch.zeros(n), seeds, pos)
    assert (run(0.0, 0) == 0).all()
    top2 = run(1.0, 2)
    assert set(top2.tolist()) == {0, 1}
    assert abs((top2 == 0).float().mean().item() - 1 / (1 + math.exp(-1))) < 0.06


def test_top_k_first_draw_is_the_whole_vocabularys_draw():
    """The top-k-first draw hashes noise for its candidates only; a token's noise
    depends on its id alone, so it draws what the dense filter plus dense noise does."""
    g = torch.Generator().manual_seed(1)
    n, v = 400, 300
    logits = torch.randn(n, v, generator=g) * 2
    t = torch.rand(n, generator=g) + 0.2
    k = torch.randint(1, 20, (n,), generator=g)
    p, m = torch.rand(n, generator=g) * 0.5 + 0.5, torch.rand(n, generator=g) * 0.1
    seed, pos = torch.arange(n) * 7919, torch.randint(0, 4000, (n,), generator=g)
    dense = (filter_logits(logits, t, k, p, m) + gumbel_noise(seed, pos, v)).argmax(-1)
    assert torch.equal(draw(logits, t, k, p, m, seed, pos, width=20), dense)
    assert torch.equal(draw(logits, t, k, p, m, seed, pos), dense)


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=1e30), "<= 100"),
    (dict(temperature=100.5), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=2.0), "min_p")])
def test_out_of_range_parameters_are_refused_by_name(kw, field):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**kw)


def test_unset_fields_take_the_checkpoints_defaults():
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
             "eos_token_id": [1, 2]}
    d = checkpoint_defaults(qwen3)
    assert d == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    p = resolve({"top_k": 5, "seed": 3}, d)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (0.6, 5, 0.95, 0.0, 3)
    assert resolve({}, {}).greedy
    assert len({resolve({}, {}).seed for _ in range(5)}) > 1      # unseeded: a seed each
    assert GREEDY.greedy and resolve({"temperature": 0.0}, d).greedy


@pytest.mark.parametrize("v", [151936, 4096 + 77])
def test_top_k_over_chunks_is_exactly_topk(v):
    """The top-k over the vocabulary ranks only the chunks with the highest maxima (and
    the tail past the last whole one): topk's values, each from its own column, with
    the top k spread over chunks, all in one chunk, or in the tail."""
    torch.manual_seed(v)
    x = torch.randn(15, v).to(torch.bfloat16)
    x[:5, 640:644] = 50 + torch.arange(4.0)             # all in one chunk
    x[5:10, v - 3:] = 60 + torch.arange(3.0)            # in the tail
    x[10:, ::1000] += 8                                 # one in each of many chunks
    vals, cols = top_k(x, 4)
    assert torch.equal(vals, x.topk(4, -1).values)
    assert torch.equal(x.gather(-1, cols), vals)                # ties: any of the tied columns
    assert (cols.sort(-1).values.diff(dim=-1) > 0).all()       # each once


def test_scaled_top_is_the_top_of_the_tempered_logits():
    """What a GPU's sampling rows start from: (logits / T)'s top W (T 1 for a greedy
    row), each value at its column, and the raw logits' log-sum-exp."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(4, 151936)).to(torch.bfloat16)
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.7])
    vals, cols, lse = scaled_top(logits, temperature, 64, reference)
    want = logits.float() / torch.tensor([1.0, 0.6, 1.0, 1.7]).unsqueeze(1)
    assert torch.equal(vals, want.topk(64, -1).values)
    assert torch.equal(want.gather(-1, cols), vals)
    torch.testing.assert_close(lse, logits.float().logsumexp(-1))
