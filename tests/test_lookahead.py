"""Lookahead drafting (draft_service/lookahead.py): the draft pre-drafts each sequence's
next tree for its likeliest outcomes while the target verifies; the verify takes the
candidate whose key is what the step committed. Hits and misses change speed, never
tokens: greedy equals transformers' greedy, seeded sampling equals the same request
without speculation, a candidate tree that is garbage costs only its step, and both
services hold no page once the requests are done."""

from __future__ import annotations

import asyncio

import pytest
import torch

from treespec.common.client import AsyncTreespecClient
from treespec.common.model.paths import SHIPPED_DIR
from treespec.common.runtime.kv_cache import SeqPages
from treespec.common.spec.messages import SeqUpdate, SpecRequest
from treespec.common.spec.tree import envelope_from
from treespec.draft_service import engine as draft_engine
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.engine import DraftEngine
from treespec.draft_service.lookahead import likely_path
from treespec.verify_service.draft_sync import LOOKAHEAD_TRIES, AheadPrice
from inproc import greedy_reference, services

PROMPTS = [[1, 5, 9, 13, 2, 7, 1, 5, 9, 13, 2, 7, 1, 5], [3, 4, 5, 6]]
MAX_TOKENS = 20


def _draft_free(h: dict) -> int | None:
    cache = getattr(h["draft_engine"].proposer, "cache", None)
    return None if cache is None else cache.blocks.num_free


async def _pages_back(h: dict, draft_free: int | None) -> bool:
    """Whether both services hold no sequence's KV page (the draft hears of ended
    sequences with the verify's idle notice)."""
    for _ in range(100):
        if h["engine"].kv_pages_used == 0 and _draft_free(h) == draft_free \
                and h["draft_engine"].num_sequences == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def _run(target, method, draft_model, envelope, lookahead=1, sampling=None):
    async with services(target, method, draft_model, envelope,
                        draft_kw={"lookahead": lookahead}) as h:
        free = _draft_free(h)
        async with AsyncTreespecClient(h["addr"]) as c:
            outs = await asyncio.gather(*[
                c.generate(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True,
                           **(sampling or {})) for p in PROMPTS])
            plain = None
            if sampling:
                plain = await asyncio.gather(*[
                    c.generate(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True,
                               no_speculation=True, **sampling) for p in PROMPTS])
        return outs, plain, dict(h["engine"].lookahead), await _pages_back(h, free)


@pytest.mark.parametrize("proposer,envelope", [
    ("model-self", "chain4"),       # the draft is the target: its guesses come true (hits)
    ("model-self", "tree-small"),
    ("model-random", "tree-small"),  # a random draft: its guesses fail (misses)
    ("ngram", "chain4"),
])
def test_lookahead_greedy_equals_plain(target_dir, draft_dir, proposer, envelope):
    method, model = {"model-self": ("model", target_dir), "model-random": ("model", draft_dir),
                     "ngram": ("ngram", None)}[proposer]
    outs, _, counts, free = asyncio.run(_run(target_dir, method, model, envelope))
    for p, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_reference(target_dir, p, MAX_TOKENS)
    assert free
    if proposer == "model-self":
        assert counts["hits"] >= 4
    if proposer == "model-random":
        assert counts["misses"] > 0


def test_lookahead_seeded_sampling_equals_no_speculation(target_dir):
    """Coupled acceptance: the drafter guesses the target's draws with its seeded noise;
    hit or miss, the tokens are those of the same request decoded plain."""
    sampling = {"temperature": 0.8, "seed": 11}
    outs, plain, counts, free = asyncio.run(
        _run(target_dir, "model", target_dir, "chain4", sampling=sampling))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert counts["hits"] > 0 and free


def test_garbage_candidates_cost_speed_never_tokens(target_dir, monkeypatch):
    """A lookahead whose keys come true but whose trees are random tokens: every hit
    verifies garbage, and the output is still plain greedy's."""
    real = draft_engine.draft_candidates

    def garbage(proposer, rows, per_seq, kw):
        keys, trees = real(proposer, rows, per_seq, kw)
        g = torch.Generator().manual_seed(0)
        trees.tokens = torch.randint(0, 100, trees.tokens.shape, generator=g,
                                     dtype=torch.int32)
        return keys, trees

    monkeypatch.setattr(draft_engine, "draft_candidates", garbage)
    outs, _, counts, free = asyncio.run(_run(target_dir, "model", target_dir, "chain4"))
    for p, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_reference(target_dir, p, MAX_TOKENS)
    assert counts["hits"] > 0 and free


def _engine(method, model=None, envelope="chain4", k=1) -> DraftEngine:
    return DraftEngine(DraftConfig(method=method, envelope=envelope_from(envelope),
                                   model=None if model is None else str(model), device="cpu",
                                   lookahead=k))


def test_engine_lookahead_rolls_the_drafter_back(target_dir):
    """After pre-drafting, the drafter holds the committed tokens only (the guesses are
    taken back), and a hit names a candidate the engine hands back as this step's tree."""
    e = _engine("model", target_dir)
    toks = [3, 4, 5, 6, 7, 8]
    req = SpecRequest(1, [SeqUpdate(5, len(toks), toks, full=True, lookahead=True)])
    tree = e.step(req).trees
    ahead = e.lookahead(req)
    st = e.proposer.state(5)
    assert st.tokens == toks and st.pages.kv_len <= len(toks)
    key = ahead.keys[0][ahead.keys[0] >= 0].tolist()
    assert key[:-1] == likely_path(tree.tokens[0].tolist(), tree.parents[0].tolist())
    # a fresh engine told the guessed path drafts the bonus guess, then told path + guess
    # the candidate, as deep as the step's tree
    fresh = _engine("model", target_dir)
    ref = fresh.step(SpecRequest(1, [SeqUpdate(9, len(toks) + len(key) - 1, toks + key[:-1],
                                               full=True)])).trees.tokens[0].tolist()
    assert ref[0] == key[-1]
    ref = fresh.step(SpecRequest(2, [SeqUpdate(9, len(toks) + len(key), key[-1:],
                                               accepted_step_id=1)])).trees.tokens[0]
    assert torch.equal(ahead.trees.tokens[0], ref)
    # the verify takes candidate 0: no tree is drafted for it, and the next lookahead
    # hangs off that candidate
    hit = SpecRequest(2, [SeqUpdate(5, len(toks) + len(key), key, accepted_step_id=1,
                                    lookahead_hit=1, lookahead=True)])
    assert not any(e.step(hit).trees.num_valid())
    assert e._seqs[5].tree == (ahead.trees.tokens[0].tolist(), ahead.trees.parents[0].tolist())
    assert e.lookahead(hit) is not None


def test_engine_unknown_candidate_is_no_tree(target_dir):
    """A hit naming a candidate this engine does not have (out of range, or for another
    step) is answered with no tree and no lookahead for it, never an error."""
    e = _engine("ngram", k=2)
    toks = [1, 2, 3, 1, 2, 3, 1, 2]
    e.step(SpecRequest(1, [SeqUpdate(4, len(toks), toks, full=True, lookahead=True)]))
    req = SpecRequest(2, [SeqUpdate(4, len(toks) + 1, [3], accepted_step_id=1,
                                    lookahead_hit=2, lookahead=True)])
    resp = e.step(req)
    assert resp.resync == [] and not any(resp.trees.num_valid())
    assert e.lookahead(req).seq_ids == []      # asked: an answer, with no candidate
    assert len(e.proposer._index[4]) == len(toks) + 1


def test_lookahead_stops_where_it_does_not_pay():
    """Priced per connection: a hit saves a draft answer's time, and every step pays its
    wait for the lookahead. Late lookaheads (a draft slower than the verify) or guesses
    that never come true stop the asking after a few steps, but for one in 64."""
    late = AheadPrice()
    late.answered(0.010)                      # a draft's answer takes 10 ms
    for _ in range(LOOKAHEAD_TRIES):
        late.step(hits=1, misses=1, waited_s=0.008)      # saves 5 ms, waits 8
    assert not late.worth(63) and late.worth(64)
    good = AheadPrice()
    good.answered(0.010)
    for _ in range(LOOKAHEAD_TRIES):
        good.step(hits=1, misses=1, waited_s=0.0005)
    assert good.worth(63)


def test_engine_lookahead_under_a_budget_is_one_probe(target_dir):
    """Where the step's trees are shallower than the envelope (the controller's budget),
    the probe drafts one level deeper and its subtree under the guess is the candidate:
    as deep as the step's tree, from one draft step."""
    e = _engine("model", target_dir)
    toks = [3, 4, 5, 6, 7, 8]
    req = SpecRequest(1, [SeqUpdate(5, len(toks), toks, full=True, lookahead=True)],
                      max_depth=3)
    tree = e.step(req).trees
    assert tree.num_valid() == [3]
    ahead = e.lookahead(req)
    key = ahead.keys[0][ahead.keys[0] >= 0].tolist()
    fresh = _engine("model", target_dir)
    probe = fresh.step(SpecRequest(1, [SeqUpdate(9, len(toks) + 3, toks + key[:-1],
                                                 full=True)])).trees.tokens[0].tolist()
    assert [probe[0]] == key[-1:] and ahead.trees.num_valid()[0] == 3
    assert ahead.trees.tokens[0].tolist()[:3] == probe[1:]


SHIPPED_TARGET, SHIPPED_HEAD = SHIPPED_DIR / "tiny-code", SHIPPED_DIR / "tiny-code-eagle3"


@pytest.mark.parametrize("envelope", ["chain4", "tree-small"])
def test_eagle3_lookahead_greedy_equals_plain(envelope):
    """EAGLE-3 pre-drafts with its own outputs as the guessed tokens' features: the
    shipped head's guesses come true on the shipped target's code, and the output is
    plain greedy's."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(SHIPPED_TARGET)
    prompts = [tok.encode("import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n"),
               tok.encode("class Stack:\n    def __init__(self):\n        self.items = []\n")]

    async def go():
        async with services(SHIPPED_TARGET, "eagle3", SHIPPED_HEAD, envelope,
                            draft_kw={"lookahead": 1}) as h:
            free = _draft_free(h)
            async with AsyncTreespecClient(h["addr"]) as c:
                outs = await asyncio.gather(*[c.generate(prompt_ids=p, max_tokens=32,
                                                         ignore_eos=True) for p in prompts])
            return outs, dict(h["engine"].lookahead), await _pages_back(h, free)
    outs, counts, free = asyncio.run(go())
    for p, out in zip(prompts, outs):
        assert out.token_ids == greedy_reference(SHIPPED_TARGET, p, 32)
    assert counts["hits"] > 0 and counts["misses"] > 0 and free


def test_engine_eagle3_lookahead_leaves_the_drafter_as_it_was():
    """After pre-drafting, the EAGLE-3 drafter holds the committed pairs only (feature
    rows and tokens), and its next tree is the one drafted without the lookahead."""
    toks = list(range(40, 60))
    trees = []
    for k in (1, 0):
        e = DraftEngine(DraftConfig(method="eagle3", envelope=envelope_from("tree-small"),
                                    model=str(SHIPPED_HEAD), device="cpu", lookahead=k))
        hidden = torch.randn(len(toks) + 4, e.proposer.head.spec.feature_size,
                             generator=torch.Generator().manual_seed(0))
        req = SpecRequest(1, [SeqUpdate(5, len(toks), toks, full=True, lookahead=bool(k),
                                        hidden=hidden[:len(toks)])])
        tree = e.step(req).trees
        if k:
            ahead = e.lookahead(req)
            assert ahead.seq_ids == [5]
            st = e.proposer.state(5)
            assert st.tokens == toks and st.feats.len == len(toks) - 1 and not st.guessed
        path = likely_path(tree.tokens[0].tolist(), tree.parents[0].tolist())[:1]
        new = path + [7]
        trees.append(e.step(SpecRequest(2, [SeqUpdate(
            5, len(toks) + len(new), new, accepted_step_id=1,
            hidden=hidden[len(toks):len(toks) + len(new)])])).trees)
    assert torch.equal(trees[0].tokens, trees[1].tokens)
    assert torch.equal(trees[0].parents, trees[1].parents)


def test_eagle3_lookahead_seeded_sampling_equals_no_speculation():
    """Coupled acceptance with EAGLE-3's lookahead: its probe draws the bonus guesses with
    the request's seeded noise; hit or miss, the tokens are the plain request's."""
    from transformers import AutoTokenizer
    prompt = AutoTokenizer.from_pretrained(SHIPPED_TARGET).encode(
        "def mean(xs):\n    total = 0\n    for x in xs:\n")
    sampling = {"temperature": 0.8, "seed": 11}

    async def go():
        async with services(SHIPPED_TARGET, "eagle3", SHIPPED_HEAD, "chain4",
                            draft_kw={"lookahead": 1}) as h:
            free = _draft_free(h)
            async with AsyncTreespecClient(h["addr"]) as c:
                spec = await c.generate(prompt_ids=prompt, max_tokens=32, ignore_eos=True,
                                        **sampling)
                plain = await c.generate(prompt_ids=prompt, max_tokens=32, ignore_eos=True,
                                         no_speculation=True, **sampling)
            return spec, plain, dict(h["engine"].lookahead), await _pages_back(h, free)
    spec, plain, counts, free = asyncio.run(go())
    assert spec.token_ids == plain.token_ids
    assert counts["hits"] + counts["misses"] > 0 and free


def test_engine_eagle3_guessed_pages_never_join_the_prefix_cache():
    """A lookahead's guessed pairs carry the head's own features, not the target's: the
    pages they fill are not offered to the prefix cache, and the committed ones are."""
    toks = list(range(40, 40 + 15))           # 14 committed pairs; pages of 4
    e = DraftEngine(DraftConfig(method="eagle3", envelope=envelope_from("chain4"),
                                model=str(SHIPPED_HEAD), device="cpu", lookahead=1,
                                block_size=4))
    hidden = torch.randn(len(toks), e.proposer.head.spec.feature_size,
                         generator=torch.Generator().manual_seed(0))
    req = SpecRequest(1, [SeqUpdate(5, len(toks), toks, full=True, lookahead=True,
                                    hidden=hidden)])
    e.step(req)
    assert e.proposer.state(5).pages.registered == 3     # units 0-11 in whole pages
    ahead = e.lookahead(req)                 # the probe's units reach 14 + 4 guessed
    guessed = toks + ahead.keys[0][ahead.keys[0] >= 0].tolist()
    cache = e.proposer.cache
    assert len(cache.cached_prefix(SeqPages(), guessed)) == 3
    assert len(cache.cached_prefix(SeqPages(), toks + [1] * 6)) == 3


def test_engine_eagle3_lookahead_after_its_kv_was_dropped():
    """A sequence whose draft KV was dropped for pages still gets a candidate (its guessed
    pairs take zero features) and is left at its committed pairs."""
    toks = list(range(40, 60))
    e = DraftEngine(DraftConfig(method="eagle3", envelope=envelope_from("chain4"),
                                model=str(SHIPPED_HEAD), device="cpu", lookahead=1))
    hidden = torch.randn(len(toks), e.proposer.head.spec.feature_size,
                         generator=torch.Generator().manual_seed(0))
    req = SpecRequest(1, [SeqUpdate(5, len(toks), toks, full=True, lookahead=True,
                                    hidden=hidden)])
    e.step(req)
    st = e.proposer.state(5)
    e.proposer.cache.release(st.pages)
    ahead = e.lookahead(req)
    assert ahead.seq_ids == [5] and ahead.trees.num_valid() == [4]
    assert st.tokens == toks and st.feats.len == len(toks) - 1 and not st.guessed


def test_eagle3_lookahead_after_a_hit_drafts_from_the_targets_features():
    """A hit step drafts nothing, so the pairs it committed have no draft KV when the next
    lookahead starts: it writes them from their target features first, and its
    candidates are those of a sequence whose step drafted when asked (zero features in
    their place cost a third of the accepted tokens on hits after hits)."""
    toks = list(range(40, 60))
    cand = None
    aheads = []
    for hit in (True, False):
        e = DraftEngine(DraftConfig(method="eagle3", envelope=envelope_from("chain4"),
                                    model=str(SHIPPED_HEAD), device="cpu", lookahead=1))
        hidden = torch.randn(len(toks) + 8, e.proposer.projection.shape[1],
                             generator=torch.Generator().manual_seed(0))
        req = SpecRequest(1, [SeqUpdate(5, len(toks), toks, full=True, lookahead=True,
                                        hidden=hidden[:len(toks)])])
        e.step(req)
        key = e.lookahead(req).keys[0]
        new = key[key >= 0].tolist()            # the step's outcome: the candidate's key
        req = SpecRequest(2, [SeqUpdate(5, len(toks) + len(new), new, accepted_step_id=1,
                                        lookahead=True, lookahead_hit=int(hit),
                                        hidden=hidden[len(toks):len(toks) + len(new)])])
        tree = e.step(req).trees
        assert (tree.parents[0] == -2).all() == hit         # a hit drafts no tree
        if hit:
            cand = e._seqs[5].tree
        else:           # the step verifies the same tree, drafted when asked
            e._seqs[5].tree = cand
        aheads.append(e.lookahead(req))
    assert torch.equal(aheads[0].keys, aheads[1].keys)
    assert torch.equal(aheads[0].trees.tokens, aheads[1].trees.tokens)
