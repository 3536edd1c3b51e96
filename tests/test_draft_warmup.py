"""What keeps a draft's step off compiles and captures while it serves (the cause of
issue 15's fallbacks on the H200: a first step at a new batch or page bucket took
1.9-6.9 s, past the verify's deadline). On the CPU the same bookkeeping runs eagerly."""

from __future__ import annotations

from treespec.common.runtime.graph_buckets import BATCH_BUCKETS, BucketedGraphs
from treespec.common.runtime.kv_cache import SeqPages
from treespec.common.spec.sampling import TOPK_FIRST
from treespec.common.spec.tree import envelope_from
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.model_proposer import ModelProposer
from treespec.kernels.triton_tree_attention import _plan


def test_a_decoding_batch_keeps_one_page_bucket(draft_dir):
    prop = ModelProposer.from_config(DraftConfig(
        method="model", model=str(draft_dir), envelope=envelope_from("chain4"), device="cpu",
        kernels="reference", num_blocks=64, block_size=4))
    gb = BucketedGraphs(prop.cache, capture=True, min_pages=256)
    widths = [1, 17, 100, 256]                          # 16 .. 4096 tokens of 16
    assert {gb.shape([SeqPages(pages=[0] * w)])[1] for w in widths} == {256}
    assert gb.shape([SeqPages(pages=[0] * 257)])[1] == 512


def test_capture_all_covers_every_batch_bucket_in_every_family(draft_dir):
    prop = ModelProposer.from_config(DraftConfig(
        method="model", model=str(draft_dir), envelope=envelope_from("chain4"), device="cpu",
        kernels="reference", num_blocks=64, block_size=4))
    prop.graphs.capture_all(16)
    want = [b for b in BATCH_BUCKETS if b <= 16]
    for family in ("step", ("step-sampled", TOPK_FIRST), ("step-sampled", -1)):
        assert prop.graphs.buckets.batches(family) == want


def test_attention_split_counts_take_six_values():
    """The split count is a compile-time constant: few values, few compiles."""
    import torch
    seen = {_plan(q, s, 2, 8, ctx, torch.device("cpu"), None, None, None)[2]
            for q in (1, 4, 16, 64, 320, 4096) for s in (1, 2, 8, 32, 64)
            for ctx in (16, 300, 1100, 2100, 4096, 40000) if q >= s}
    assert seen <= {1, 2, 3, 5, 9, 17}


def test_long_chunks_plan_one_split(monkeypatch):
    """A catch-up of a resting sequence runs eagerly at any length (the H200's EAGLE-3
    draft compiled a kernel for a 129-unit catch-up while serving): long chunks always
    take one split, so their compile-time constants do not follow the length."""
    import torch
    from treespec.kernels import triton_tree_attention
    monkeypatch.setattr(triton_tree_attention, "_num_sms", lambda device: 132)   # an H200
    for q in (100, 129, 300, 1024, 5000):
        for ctx in (200, 1100, 4096):
            plan = _plan(q, 1, 4, 8, ctx, torch.device("cpu"), None, None, None)
            assert plan[0] == 128 and plan[2] == 1, (q, ctx, plan)
    # a captured tree step (its ancestors given) keeps its splits: 65 nodes at batch 1
    assert _plan(65, 1, 4, 8, 1100, torch.device("cpu"), None, None, None, tree=True)[2] > 1


def test_catch_up_splits_follow_the_batch_not_the_context(monkeypatch):
    """An eager catch-up's table is its context's own width; its split count (a
    compile-time constant) is planned as for a captured step's smallest table at least,
    so the warm-up's catch-ups at short contexts compile what one at 4096+ tokens needs
    (an H200's EAGLE-3 draft compiled two kernels at ctx 4096 while serving: 1.4-1.7 s)."""
    import torch
    from treespec.kernels import triton_tree_attention
    monkeypatch.setattr(triton_tree_attention, "_num_sms", lambda device: 132)   # an H200
    for q in (1, 3, 15, 40):                      # catch-up chunks of one sequence, 4 heads
        splits = {_plan(q, 1, 4, 8, ctx, torch.device("cpu"), None, None, None)[2]
                  for ctx in (64, 300, 1100, 2100, 4096, 9000, 40000)}
        assert len(splits) == 1, (q, splits)
