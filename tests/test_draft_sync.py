"""DraftSync: what each request tells the draft. Updates carry only what is new; the
target hidden states of a step stay under a byte budget, a sequence's prompt crossing
over as many steps as it takes (its tree unused until it has), and what crosses over
the steps is exactly what one full update would have carried."""

from __future__ import annotations

import torch

from treespec.common.runtime.row_buffer import RowBuffer
from treespec.verify_service.draft_sync import DraftSync
from treespec.verify_service.request import GenRequest
from treespec.verify_service.sequence import Sequence

C = 4                           # hidden width: 16 bytes a float32 row


def seq(n: int, seed: int) -> Sequence:
    s = Sequence(GenRequest(prompt_ids=tuple(range(1, n + 1)), max_tokens=50), frozenset(), 999)
    s.hidden = RowBuffer(torch.randn(n - 1, C, generator=torch.Generator().manual_seed(seed)))
    return s


def commit(s: Sequence, k: int) -> None:
    """k more committed tokens, with the hidden rows of the tokens before them."""
    s.hidden.append(torch.randn(k, C))
    s.tokens.extend([7] * k)


def test_updates_carry_only_what_is_new_and_name_the_last_tree():
    sync = DraftSync()
    a = seq(5, 0)
    out = sync.request([a], hidden=False, trace={})
    u = out.request.seqs[0]
    assert (u.full, u.committed_len, u.new_tokens, u.hidden) == (True, 5, [1, 2, 3, 4, 5], None)
    sync.sent([a], out)
    commit(a, 2)
    a.accepted_path = [0]
    out = sync.request([a], hidden=False, trace={})
    u = out.request.seqs[0]
    assert (u.full, u.committed_len, u.new_tokens) == (False, 7, [7, 7])
    assert (u.accepted_nodes, u.accepted_step_id) == ([0], 1) and out.syncing == []
    sync.sent([a], out)
    sync.resync([a.seq_id])                       # the draft lost it: full again
    assert sync.request([a], hidden=False, trace={}).request.seqs[0].full


def test_hidden_states_cross_under_the_budget_and_add_up_to_a_full_update():
    sync = DraftSync(max_hidden_bytes=10 * 16)    # 10 rows a request
    a, b, c = seq(8, 1), seq(7, 2), seq(3, 3)
    seqs = [a, b, c]
    want = {s.seq_id: torch.cat([torch.zeros(1, C), s.hidden.rows]) for s in seqs}
    got: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
    trace = []
    for step in range(4):
        out = sync.request(seqs, hidden=True, trace={})
        assert sum(u.hidden.shape[0] for u in out.request.seqs) <= 10
        assert out.hidden_bytes == sum(u.hidden.numel() * u.hidden.element_size()
                                       for u in out.request.seqs)
        for u in out.request.seqs:
            assert u.committed_len - len(u.new_tokens) == sum(x.shape[0] for x in got[u.seq_id])
            got[u.seq_id].append(u.hidden.clone())
        trace.append((out.rows, out.syncing))
        sync.sent(seqs, out)
        if not out.syncing:
            break
        for s in seqs:
            commit(s, 1)
            want[s.seq_id] = torch.cat([want[s.seq_id], s.hidden.rows[-1:]])
    # step 1: a whole (8 rows), b's first 2, c nothing; then b and c catch up
    assert trace[0] == ([0, 1], [1, 2])
    assert trace[-1][1] == [] and len(trace) == 3
    for s in seqs:
        assert torch.equal(torch.cat(got[s.seq_id]), want[s.seq_id])


def test_rows_leave_projected_where_the_draft_gave_its_projection():
    """[2, C] projection: each row crosses as its product (2 columns of 4), and the
    budget counts those bytes, so twice the rows fit in a request; a projection of
    another width than the rows' is not used."""
    w = torch.randn(2, C, generator=torch.Generator().manual_seed(9))
    a = seq(9, 1)
    sync = DraftSync(max_hidden_bytes=4 * 16)            # 4 unprojected rows a request
    sync.reset(projection=w)
    out = sync.request([a], hidden=True, trace={})
    u = out.request.seqs[0]
    assert u.committed_len == 8 and out.syncing == [0] and out.hidden_bytes == 8 * 2 * 4
    want = torch.cat([torch.zeros(1, C), a.hidden.rows[:7]]) @ w.T
    torch.testing.assert_close(u.hidden, want)
    sync.reset(projection=torch.randn(2, C + 1))
    u = sync.request([a], hidden=True, trace={}).request.seqs[0]
    assert u.hidden.shape == (4, C) and torch.equal(u.hidden[1:], a.hidden.rows[:3])
