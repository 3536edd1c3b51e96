"""A captured step replays only at its own shape; the fixed-shape step of a batch
(padded to its bucket) equals the step of each sequence alone."""

from __future__ import annotations

import pytest
import torch

from treespec.common.runtime.cuda_graph import ShapeMismatch, StaticGraph
from treespec.common.runtime.kv_cache import SeqPages
from treespec.common.model.qwen3 import Qwen3Model
from treespec.kernels import reference as ops
from treespec.common.spec.tree import TreeBatch
from treespec.verify_service.verifier import Verifier, VerifyBatch


def test_mismatched_shape_or_dtype_is_refused():
    g = StaticGraph(lambda x, y: (x + y,), [torch.zeros(2, 3), torch.zeros(2, 3)], capture=False)
    assert torch.equal(g(torch.ones(2, 3), torch.ones(2, 3))[0], torch.full((2, 3), 2.0))
    with pytest.raises(ShapeMismatch, match=r"captured for \(2, 3\)"):
        g(torch.ones(3, 3), torch.ones(2, 3))
    with pytest.raises(ShapeMismatch, match="int32"):
        g(torch.ones(2, 3, dtype=torch.int32), torch.ones(2, 3))
    with pytest.raises(ShapeMismatch, match="takes 2 inputs"):
        g(torch.ones(2, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to capture")
def test_captured_graph_refuses_other_shapes():
    x = torch.zeros(4, device="cuda")
    g = StaticGraph(lambda a: (a * 2,), [x])
    assert g.graph is not None
    assert g(torch.ones(4, device="cuda"))[0].sum().item() == 8
    with pytest.raises(ShapeMismatch):
        g(torch.ones(5, device="cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to capture")
def test_host_arguments_go_through_the_graphs_staging():
    """Host tensors upload through the graph's pinned staging: each replay sees its
    own call's values, also when the host tensor is changed right after the call."""
    g = StaticGraph(lambda a: (a * 2,), [torch.zeros(4, dtype=torch.int32, device="cuda")])
    assert g.graph is not None
    seen = []
    for k in range(5):
        host = torch.full((4,), k, dtype=torch.int32)
        out = g(host)[0]
        host.fill_(-1)                           # the caller reuses its buffer at once
        seen.append(out.cpu().tolist())
    assert seen == [[2 * k] * 4 for k in range(5)]


def test_batched_fixed_step_equals_each_sequence_alone(target_dir):
    model = Qwen3Model.from_pretrained(target_dir)
    prompts = [[1, 5, 9, 13, 2, 7], [3, 4, 5], [8, 8, 8, 8, 8, 8, 8, 8, 8]]
    probe = Verifier(model, model.new_cache(64, 4), ops)
    firsts, _ = probe.prefill([SeqPages() for _ in prompts], prompts)
    seconds, _ = probe.prefill([SeqPages() for _ in prompts],
                               [p + [f] for p, f in zip(prompts, firsts)])
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 96, (3, 6), generator=g, dtype=torch.int32)
    tokens[:, 0] = torch.tensor(seconds)       # the target's next token: accepted
    parents = torch.tensor([[-1, 0, 1, -1, 3, -2]] * 3, dtype=torch.int32)

    def run(rows: list[int]) -> tuple:
        v = Verifier(model, model.new_cache(64, 4), ops, capture=False)
        pages = [SeqPages() for _ in rows]
        assert v.prefill(pages, [prompts[r] for r in rows])[0] == [firsts[r] for r in rows]
        res = v.step(VerifyBatch(pages, [firsts[r] for r in rows],
                                 TreeBatch(tokens[rows], parents[rows]), depth=3))
        res2 = v.step(VerifyBatch(pages, res.bonus))
        return v, (res.accepted, res.bonus, res2.bonus, [p.kv_len for p in pages])

    v, together = run([0, 1, 2])
    # batch 3 ran in bucket 4; buckets 1 and 2 were made at the same shapes
    assert {(k[1], k[0][0]) for k in v.buckets.graphs} == {(b, n) for b in (1, 2, 4) for n in (0, 6)}
    alone = [run([r])[1] for r in range(3)]
    assert together == tuple([x for a in alone for x in a[i]] for i in range(4))
    assert any(together[0])


def test_warm_up_and_first_captures_cover_every_batch_bucket_to_max_batch(target_dir):
    """No step of a growing batch stalls on a capture: the warm-up makes plain decode's
    graphs (greedy, top-k first, whole vocabulary) at every bucket up to max_batch's,
    and a tree's first step makes its family at all of them too."""
    from treespec.common.spec.sampling import TOPK_FIRST
    model = Qwen3Model.from_pretrained(target_dir)
    v = Verifier(model, model.new_cache(64, 4), ops, max_batch=20)
    v.warm_up()
    want = [1, 2, 4, 8, 16, 32]
    for width in (0, TOPK_FIRST, -1):
        assert v.buckets.batches((0, (), width, 0, 0)) == want
    pages = [SeqPages()]
    first, _ = v.prefill(pages, [[1, 5, 9]])
    tree = TreeBatch(torch.tensor([[first[0], 3]], dtype=torch.int32),
                     torch.tensor([[-1, 0]], dtype=torch.int32))
    v.step(VerifyBatch(pages, first, tree, depth=2))
    assert v.buckets.batches((2, (), 0, 0, 0)) == want
    assert len(v.buckets.graphs) == 4 * len(want)


def test_a_drafts_budgets_are_captured_when_it_connects(target_dir):
    """A draft's handshake (its hidden layers, the controller's budgets) warms each
    budget's graph at every bucket too: the first non-empty tree of a batch (n-gram on
    prompts without matches: none until batch 32 on the H200) stalls nothing."""
    model = Qwen3Model.from_pretrained(target_dir)
    v = Verifier(model, model.new_cache(64, 4), ops, max_batch=20)
    budgets = [(4, 4), (2, 2), (1, 1)]
    assert v.use_draft((1,), budgets) == (model.device.type == "cuda")
    assert not v.use_draft((1,), budgets)           # the same draft again: nothing new
    v.warm_up()
    for w, _ in budgets:
        assert v.buckets.batches((w, (1,), 0, 0, 0)) == [1, 2, 4, 8, 16, 32]


def test_a_draft_steps_outputs_cross_as_one_tensor_and_back():
    """draft_graphs.pack / unpack: what a drafter's step returns (tokens, parents,
    positions, q ids and probabilities, any float) survives the one readback exactly."""
    from treespec.draft_service.draft_graphs import pack, unpack
    g = torch.Generator().manual_seed(0)
    out = (torch.randint(0, 150_000, (3, 4), generator=g, dtype=torch.int32),
           torch.randint(-2, 4, (3, 4), generator=g),                       # int64
           torch.randint(0, 9, (3,), generator=g),
           torch.randint(0, 150_000, (3, 4, 5), generator=g, dtype=torch.int32),
           torch.rand(3, 4, 5, generator=g), torch.rand(3, 2, generator=g).bfloat16(),
           torch.rand(3, generator=g) > 0.5)
    packed = pack(out)
    assert packed.dtype == torch.int32 and packed.shape == (3, 4 + 4 + 1 + 20 + 20 + 2 + 1)
    back = unpack(packed[:2], [(tuple(x.shape[1:]), x.dtype) for x in out])
    for x, y in zip(out, back):
        assert y.dtype == x.dtype and torch.equal(y, x[:2])
