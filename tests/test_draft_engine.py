"""DraftEngine: state rules (resync, release, LRU), malformed requests, shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from treespec.common.serving.errors import InvalidRequest
from treespec.common.spec.messages import SeqUpdate, SpecRequest
from treespec.common.spec.tree import PAD, TreeBatch, envelope_from, validate_tree
from treespec.draft_service import engine as draft_engine
from treespec.draft_service.config import DraftConfig

ENV = envelope_from("tree-small")
N = ENV.num_nodes


class DraftEngine(draft_engine.DraftEngine):
    """The engine, its answers read flat: step ids, rows and the trees' tensors."""

    def step(self, req: SpecRequest) -> SimpleNamespace:
        r = super().step(req)
        return SimpleNamespace(step_id=r.step_id, seq_ids=r.seq_ids, resync=r.resync,
                               tokens=r.trees.tokens, parents=r.trees.parents)


def ngram_engine(**kw) -> DraftEngine:
    return DraftEngine(DraftConfig(method="ngram", envelope=ENV, **kw))


def full(seq_id: int, tokens: list[int]) -> SeqUpdate:
    return SeqUpdate(seq_id=seq_id, committed_len=len(tokens), new_tokens=list(tokens), full=True)


class Spy:
    """A proposer that records calls and proposes token = seq_id at node 0."""

    name = "spy"
    vocab_size = 100
    target_hidden_layers = (1, 2)
    model = "spy"

    def __init__(self, fail: bool = False) -> None:
        self.updates: list[tuple] = []
        self.released: list[int] = []
        self.fail = fail

    def update(self, seq_id, tokens, new_count, accepted_nodes, hidden):
        self.updates.append((seq_id, list(tokens), new_count, list(accepted_nodes)))

    def propose(self, seq_ids, sampling=None):
        if self.fail:
            raise RuntimeError("proposer bug")
        t = torch.zeros(len(seq_ids), N, dtype=torch.int32)
        p = torch.full((len(seq_ids), N), PAD, dtype=torch.int32)
        t[:, 0] = torch.tensor([s % 100 for s in seq_ids], dtype=torch.int32)
        p[:, 0] = -1
        return TreeBatch(t, p)

    def release(self, seq_id):
        self.released.append(seq_id)


def spy_engine(**kw) -> tuple[DraftEngine, Spy]:
    spy = Spy(kw.pop("fail", False))
    return DraftEngine(DraftConfig(method="ngram", envelope=ENV, **kw), proposer=spy), spy


def test_info():
    info = ngram_engine().info
    assert (info.envelope, info.proposer, info.vocab_size, info.model) == (ENV, "ngram", 0, "")
    spy_info = spy_engine()[0].info
    assert spy_info.target_hidden_layers == (1, 2) and spy_info.model == "spy"
    assert spy_info.proposer == "spy"


def test_rows_follow_request_order_with_fixed_shapes():
    eng = ngram_engine()
    tb = eng.step(SpecRequest(step_id=5, seqs=[full(2, [1, 2, 1]), full(9, [4, 4])]))
    assert tb.step_id == 5 and tb.seq_ids == [2, 9] and tb.resync == []
    assert tb.tokens.shape == tb.parents.shape == (2, N)
    assert tb.tokens.dtype == tb.parents.dtype == torch.int32
    assert validate_tree(tb.tokens, tb.parents, N, 10) is None
    assert tb.tokens[0, 0] == 2 and tb.tokens[1, 0] == 4
    tb = eng.step(SpecRequest(step_id=6, seqs=[
        SeqUpdate(9, committed_len=3, new_tokens=[4]),
        SeqUpdate(2, committed_len=5, new_tokens=[2, 1])]))
    assert tb.seq_ids == [9, 2] and tb.resync == []
    empty = eng.step(SpecRequest(step_id=7, seqs=[]))
    assert empty.tokens.shape == (0, N)


def test_unknown_or_mismatched_sequences_resync_with_padding_rows():
    eng = ngram_engine()
    eng.step(SpecRequest(step_id=1, seqs=[full(1, [5, 6, 5])]))
    tb = eng.step(SpecRequest(step_id=2, seqs=[
        SeqUpdate(1, committed_len=9, new_tokens=[6]),          # known, wrong length
        SeqUpdate(2, committed_len=3, new_tokens=[1]),          # never seen
        full(3, [7, 7])]))
    assert tb.resync == [1, 2]
    assert (tb.parents[:2] == PAD).all() and (tb.tokens[:2] == 0).all()
    assert eng.num_sequences == 1
    # state of 1 was dropped: even a now-consistent update resyncs until a full one
    tb = eng.step(SpecRequest(step_id=3, seqs=[SeqUpdate(1, committed_len=4, new_tokens=[6])]))
    assert tb.resync == [1]
    tb = eng.step(SpecRequest(step_id=4, seqs=[full(1, [5, 6, 5, 6, 5])]))
    assert tb.resync == [] and tb.tokens[0, 0] == 6


def test_released_sequences_are_forgotten_first():
    eng, spy = spy_engine()
    eng.step(SpecRequest(step_id=1, seqs=[full(1, [1]), full(2, [2])]))
    tb = eng.step(SpecRequest(step_id=2, seqs=[SeqUpdate(1, 2, [3])], released=[2, 77]))
    assert eng.num_sequences == 1 and {2, 77} <= set(spy.released)
    tb = eng.step(SpecRequest(step_id=3, seqs=[SeqUpdate(2, 2, [3])]))
    assert tb.resync == [2]


def test_accepted_nodes_reach_the_proposer_only_for_its_last_tree():
    eng, spy = spy_engine()
    eng.step(SpecRequest(step_id=10, seqs=[full(1, [1, 2])]))
    eng.step(SpecRequest(step_id=11, seqs=[SeqUpdate(1, 4, [1, 9], accepted_nodes=[0],
                                                     accepted_step_id=10)]))
    assert spy.updates[-1] == (1, [1, 2, 1, 9], 2, [0])
    eng.step(SpecRequest(step_id=12, seqs=[SeqUpdate(1, 6, [1, 9], accepted_nodes=[0],
                                                     accepted_step_id=10)]))   # stale
    assert spy.updates[-1] == (1, [1, 2, 1, 9, 1, 9], 2, [])
    # a full reset releases the proposer's state before the new update
    eng.step(SpecRequest(step_id=13, seqs=[full(1, [4, 4, 4])]))
    assert spy.released[-1] == 1 and spy.updates[-1] == (1, [4, 4, 4], 3, [])


def test_max_sequences_evicts_the_least_recently_used():
    eng, spy = spy_engine(max_sequences=2)
    eng.step(SpecRequest(step_id=1, seqs=[full(1, [1]), full(2, [2])]))
    eng.step(SpecRequest(step_id=2, seqs=[SeqUpdate(1, 2, [1])]))      # 2 is now the LRU
    tb = eng.step(SpecRequest(step_id=3, seqs=[full(3, [3])]))
    assert tb.resync == [] and eng.num_sequences == 2 and 2 in spy.released
    tb = eng.step(SpecRequest(step_id=4, seqs=[SeqUpdate(2, 2, [2]), SeqUpdate(1, 3, [1])]))
    assert tb.resync == [2]
    # a batch larger than max_sequences: the earliest rows lose their state
    tb = eng.step(SpecRequest(step_id=5, seqs=[full(4, [4]), full(5, [5]), full(6, [6])]))
    assert tb.resync == [4] and (tb.parents[0] == PAD).all() and tb.tokens[1, 0] == 5


def test_a_failing_proposer_leaves_no_half_applied_state():
    eng, _ = spy_engine(fail=True)
    with pytest.raises(RuntimeError, match="proposer bug"):
        eng.step(SpecRequest(step_id=1, seqs=[full(1, [1, 2])]))
    assert eng.num_sequences == 0


@pytest.mark.parametrize("update, message", [
    (SeqUpdate(1, committed_len=0, new_tokens=[]), "committed_len 0 < 1"),
    (SeqUpdate(1, committed_len=-3, new_tokens=[1]), "committed_len -3"),
    (SeqUpdate(1, committed_len=3, new_tokens=[1, 2], full=True), "full update has 2 tokens"),
    (SeqUpdate(1, committed_len=2, new_tokens=[1, -1], full=True), "outside the vocabulary"),
    (SeqUpdate(1, committed_len=2, new_tokens=[1, 100], full=True), "outside the vocabulary"),
    (SeqUpdate(1, committed_len=2, new_tokens=[1], accepted_nodes=[N]), "accepted_nodes"),
    (SeqUpdate(1, committed_len=2, new_tokens=[1], accepted_nodes=[0] * 5), "accepted_nodes"),
])
def test_malformed_updates_raise_invalid_request(update, message):
    eng, _ = spy_engine()
    with pytest.raises(InvalidRequest, match=message):
        eng.step(SpecRequest(step_id=1, seqs=[update]))


def test_duplicate_sequence_is_malformed():
    eng, _ = spy_engine()
    with pytest.raises(InvalidRequest, match="twice"):
        eng.step(SpecRequest(step_id=1, seqs=[full(1, [1]), full(1, [1])]))


def test_model_engine_resyncs_and_frees_pages(draft_dir):
    eng = DraftEngine(DraftConfig(method="model", model=str(draft_dir), envelope=ENV,
                                  device="cpu", kernels="reference", num_blocks=64, block_size=4))
    info = eng.info
    assert info.vocab_size == 96 and info.proposer == "model" and info.model == str(draft_dir)
    blocks = eng.proposer.cache.blocks
    start = blocks.num_free
    tb = eng.step(SpecRequest(step_id=1, seqs=[full(1, [1, 2, 3]), full(2, [4, 5])]))
    assert validate_tree(tb.tokens, tb.parents, N, 96) is None and (tb.parents != PAD).all()
    node0 = int(tb.tokens[0, 0])
    tb = eng.step(SpecRequest(step_id=2, seqs=[
        SeqUpdate(1, committed_len=5, new_tokens=[node0, 7], accepted_nodes=[0],
                  accepted_step_id=1),
        SeqUpdate(2, committed_len=7, new_tokens=[6])]))                       # wrong length
    assert tb.resync == [2] and (tb.parents[1] == PAD).all() and (tb.parents[0] != PAD).all()
    with pytest.raises(InvalidRequest, match="vocabulary"):
        eng.step(SpecRequest(step_id=3, seqs=[full(3, [96])]))
    eng.step(SpecRequest(step_id=4, seqs=[], released=[1, 2]))
    assert blocks.num_free == start and eng.num_sequences == 0


def test_requests_past_the_draft_s_bounds_are_refused_unread():
    eng, spy = spy_engine(max_model_len=8)
    with pytest.raises(InvalidRequest, match="over the draft's --max-model-len 8"):
        eng.step(SpecRequest(step_id=1, seqs=[full(1, list(range(1, 10)))]))
    with pytest.raises(InvalidRequest, match="1025 sequences"):
        eng.step(SpecRequest(step_id=2, seqs=[full(i, [1]) for i in range(1025)]))
    assert spy.updates == [] and eng.num_sequences == 0


def test_a_budget_depth_pads_the_nodes_past_it():
    eng = ngram_engine()
    toks = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    whole = eng.step(SpecRequest(1, [full(7, toks)]))
    cut = eng.step(SpecRequest(2, [SeqUpdate(seq_id=7, committed_len=len(toks), new_tokens=[])],
                               max_depth=1))
    assert (whole.parents[0] >= 0).any()                 # it drafted past depth 1
    assert cut.parents.shape == whole.parents.shape
    kept = cut.parents[0] != PAD
    assert (cut.parents[0][kept] == -1).all() and kept.sum() >= 1   # depth-1 nodes only
    assert torch.equal(cut.tokens[0][kept], whole.tokens[0][kept])
