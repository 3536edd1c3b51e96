"""Prefix caching with the feature drafters (issue 56), through real CLI services: with
EAGLE-3 and DFlash a request sharing a cached prefix prefills only the rest on the verify
service AND the draft takes that prefix's state from its own cache (its prefix-cache
hits are the verify's cached tokens), so only the rest's hidden states cross; every
output equals a service's with --no-prefix-caching (greedy and seeded turns). A draft
that lost the prefix (evicted) or restarted costs speculation, never a token: the
sequence runs plain, the next request with that prefix prefills it, the one after
reuses it again. Pages come back on the verify service.

The shipped tiny pairs; a reference verify without prefix caching or draft; the EAGLE-3
draft short of pages (--num-blocks), so that other prompts evict its cached prefix.
"""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import services
from parallel_services import free_port
from prom import scrape, total, value
from treespec.common.client import TreespecClient

BS = 16                 # both services' default --block-size
PREFIX = 600
TURNS = 5
NEW = 40
MAX_TOKENS = 8
DRAFT_PAGES = 90        # the EAGLE-3 draft's: a 600-token prompt holds 38 of them
METRICS = re.compile(r"metrics on (http://\S+/metrics)")
SAMPLED = {"temperature": 0.8, "seed": 11}
METHODS = ("eagle3", "dflash")


def tokens(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, 1000) for _ in range(n)]


def metrics(proc) -> dict:
    return scrape(METRICS.search(proc.output()).group(1))


def draft_argv(method: str, port: int, *extra: str) -> list[str]:
    return services.draft_argv(method, "--target-embeddings", "tiny-code", "--metrics-port",
                               "0", *extra, model=f"tiny-code-{method}", port=port)


@pytest.fixture(scope="module")
def svc():
    ports = {m: free_port() for m in METHODS}
    common = ("--metrics-port", "0", "--speculation", "always", "--step-deadline-ms", "3000",
              "--reconnect-s", "0.2")
    argv = [services.verify_argv("tiny-code", "--no-prefix-caching")]
    extra = {"eagle3": ("--num-blocks", str(DRAFT_PAGES)), "dflash": ()}
    for m in METHODS:
        argv += [draft_argv(m, ports[m], *extra[m]),
                 services.verify_argv("tiny-code", *common, draft=f"127.0.0.1:{ports[m]}")]
    with services.at_once(*argv) as procs:
        ref, d_eagle, v_eagle, d_dflash, v_dflash = procs
        for v in (v_eagle, v_dflash):
            services.wait_draft_connected(v)
        clients = {"ref": TreespecClient(ref.addr), "eagle3": TreespecClient(v_eagle.addr),
                   "dflash": TreespecClient(v_dflash.addr)}
        yield {"clients": clients, "verify": {"eagle3": v_eagle, "dflash": v_dflash},
               "draft": {"eagle3": d_eagle, "dflash": d_dflash}, "ports": ports}
        for c in clients.values():
            c.close()


def generate(client: TreespecClient, prompt: list[int], seeded: bool = False):
    sampling = SAMPLED if seeded else {"temperature": 0.0}
    return client.generate(prompt_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True,
                           **sampling)


def hits(proc) -> float:
    return value(metrics(proc), "vllm:prefix_cache_hits_total")


def sent_bytes(proc) -> float:
    return total(metrics(proc), "treespec:draft_hidden_state_bytes_total")


def converse(svc, method: str, ref: dict) -> None:
    """A shared prefix, then TURNS turns on the second prompt, on one method's services:
    every later prompt's cached tokens on the verify are hits on the draft, and the
    hidden states that cross are the new tokens' only."""
    c, v, d = svc["clients"][method], svc["verify"][method], svc["draft"][method]
    prefix = tokens(1, PREFIX)
    b0 = sent_bytes(v)
    first = generate(c, prefix + tokens(2, 20))
    assert first.token_ids == ref["first"] and first.stats["cached_tokens"] == 0
    per_token = (sent_bytes(v) - b0) / (PREFIX + 20)
    prompt, before = prefix + tokens(3, 25), 0
    for turn in range(TURNS):
        h0, b0 = hits(d), sent_bytes(v)
        got = generate(c, prompt, seeded=turn % 2 == 1)
        assert got.token_ids == ref[turn], (method, turn)
        cached = got.stats["cached_tokens"]
        if turn == 0:
            assert cached == PREFIX // BS * BS
        else:   # the last turn's KV, less the page of its last step's tokens at most
            assert (before // BS - 1) * BS <= cached <= (before + 1) // BS * BS, cached
        assert hits(d) - h0 == cached, (method, turn)     # the draft's catch-up: the rest
        assert sent_bytes(v) - b0 <= (len(prompt) - cached + 2 * MAX_TOKENS) * per_token
        assert got.stats["draft_tokens"] > 0
        before = len(prompt) + MAX_TOKENS - 1
        prompt = prompt + got.token_ids + tokens(10 + turn, NEW)


def test_through_the_cli(svc):
    """One test over the one set of services (two would start them on each xdist
    worker): the turns, then an evicted prefix, then a restarted draft."""
    turns_prefill_and_sync_only_their_new_tokens(svc)
    an_evicted_prefix_costs_speculation_not_tokens(svc)
    a_restarted_draft_starts_over_and_the_output_stays(svc)


def turns_prefill_and_sync_only_their_new_tokens(svc):
    ref_c = svc["clients"]["ref"]
    prefix = tokens(1, PREFIX)
    ref = {"first": generate(ref_c, prefix + tokens(2, 20)).token_ids}
    prompt = prefix + tokens(3, 25)
    for turn in range(TURNS):
        ref[turn] = generate(ref_c, prompt, seeded=turn % 2 == 1).token_ids
        prompt = prompt + ref[turn] + tokens(10 + turn, NEW)
    with ThreadPoolExecutor(len(METHODS)) as pool:
        for f in [pool.submit(converse, svc, m, ref) for m in METHODS]:
            f.result()
    for m in METHODS:
        m_ = metrics(svc["verify"][m])
        for _ in range(50):         # a finished request's pages return at the next iteration
            if value(m_, "treespec:kv_pages_used") == 0:
                break
            m_ = metrics(svc["verify"][m])
        assert value(m_, "treespec:kv_pages_used") == 0
        assert value(m_, "treespec:kv_pages_cached") > 0


def an_evicted_prefix_costs_speculation_not_tokens(svc):
    """The EAGLE-3 draft's 90 pages: two other 600-token prompts evict the prefix it
    cached, which the verify still holds. The next request names it; the draft has lost
    it, so that request runs plain (same tokens); the one after prefills the prefix (the
    verify no longer counts it as the draft's), and the third reuses it on both again."""
    c, ref, d = svc["clients"]["eagle3"], svc["clients"]["ref"], svc["draft"]["eagle3"]
    prefix = tokens(700, PREFIX)
    prompts = [prefix + tokens(701 + i, 12 + i) for i in range(4)]
    want = [generate(ref, p).token_ids for p in prompts]
    assert generate(c, prompts[0]).token_ids == want[0]
    for i in range(2):
        generate(c, tokens(800 + i, PREFIX))
    lost = generate(c, prompts[1])
    assert lost.token_ids == want[1]
    assert lost.stats["cached_tokens"] == PREFIX // BS * BS and lost.stats["draft_tokens"] == 0
    again = generate(c, prompts[2])
    assert again.token_ids == want[2] and again.stats["cached_tokens"] == 0
    h0 = hits(d)
    last = generate(c, prompts[3])
    assert last.token_ids == want[3] and last.stats["draft_tokens"] > 0
    assert last.stats["cached_tokens"] == PREFIX // BS * BS == hits(d) - h0


def a_restarted_draft_starts_over_and_the_output_stays(svc):
    """The DFlash draft killed and started again on its port: it holds no prefix, so the
    verify reuses none for it until it has sent one again."""
    c, ref, v = svc["clients"]["dflash"], svc["clients"]["ref"], svc["verify"]["dflash"]
    prefix = tokens(900, PREFIX)
    prompts = [prefix + tokens(901 + i, 10 + i) for i in range(3)]
    want = [generate(ref, p).token_ids for p in prompts]
    assert generate(c, prompts[0]).token_ids == want[0]
    connected = v.output().count(" connected: ")
    svc["draft"]["dflash"].stop(5)
    with services.ServiceProcess("draft[dflash]", services.cli_command(
            *draft_argv("dflash", svc["ports"]["dflash"])), env=services.child_env()) as d:
        d.wait_listening(services.STARTUP_S)
        deadline = time.monotonic() + 60
        while v.output().count(" connected: ") <= connected:
            assert time.monotonic() < deadline, v.output(20)
            time.sleep(0.1)
        fresh = generate(c, prompts[1])
        assert fresh.token_ids == want[1] and fresh.stats["cached_tokens"] == 0
        h0 = hits(d)
        reused = generate(c, prompts[2])
        assert reused.token_ids == want[2]
        assert reused.stats["cached_tokens"] == PREFIX // BS * BS == hits(d) - h0


@pytest.mark.parametrize("method", METHODS)
def test_the_drafts_cached_state_is_the_state_it_would_compute(method):
    """In process, the draft engine alone: a sequence started from a cached prefix (the
    full update names cached_len and brings only the rest's rows) drafts the same trees
    as one sent every row, greedy and sampled; a prefix it does not hold is lost_prefix."""
    import torch

    from treespec.common.model.paths import SHIPPED_DIR
    from treespec.common.spec.messages import SeqUpdate, SpecRequest
    from treespec.common.spec.sampling import SamplingParams
    from treespec.common.spec.tree import PRESETS
    from treespec.draft_service.config import DraftConfig
    from treespec.draft_service.engine import DraftEngine

    def engine(prefix_caching: bool) -> DraftEngine:
        return DraftEngine(DraftConfig(
            method=method, envelope=PRESETS["tree-small"], device="cpu",
            model=str(SHIPPED_DIR / f"tiny-code-{method}"),
            target_embeddings=str(SHIPPED_DIR / "tiny-code"), prefix_caching=prefix_caching))

    cached, plain = engine(True), engine(False)
    c = cached.proposer.projection.shape[1]
    g = torch.Generator().manual_seed(0)
    # b leaves a at a page's end: the prefix's last unit (s_64, f_63) is not a's
    shared, n = 4 * BS, 90
    a = tokens(5, shared) + tokens(6, n - shared)
    b = tokens(5, shared) + tokens(7, n - shared)
    rows_a = torch.cat([torch.zeros(1, c), torch.randn(n - 1, c, generator=g)])
    # row j is the state at token j - 1, a function of the tokens up to it
    rows_b = torch.cat([rows_a[:shared + 1], torch.randn(n - shared - 1, c, generator=g)])
    k = shared
    cached.step(SpecRequest(1, [SeqUpdate(1, n, a, full=True, hidden=rows_a)]))
    sampling = SamplingParams(temperature=0.8, seed=3)
    for i, params in enumerate((None, sampling)):
        sid = 10 + i
        got = cached.step(SpecRequest(2 + i, [SeqUpdate(
            sid, n, b, full=True, hidden=rows_b[k + 1:], cached_len=k, sampling=params)]))
        want = plain.step(SpecRequest(2 + i, [SeqUpdate(
            sid, n, b, full=True, hidden=rows_b, sampling=params)]))
        assert not got.lost_prefix and not got.resync
        assert torch.equal(got.trees.tokens, want.trees.tokens), params
        assert torch.equal(got.trees.parents, want.trees.parents), params
    assert cached.proposer.cache.prefix.hits >= 2 * k
    other = tokens(8, n)
    miss = cached.step(SpecRequest(9, [SeqUpdate(20, n, other, full=True,
                                                 hidden=rows_b[k + 1:], cached_len=k)]))
    assert miss.lost_prefix == [20] and not miss.resync
    assert not miss.trees.num_valid()[0]
