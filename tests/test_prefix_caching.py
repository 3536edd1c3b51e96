"""Prefix caching through real CLI services (issue 56): a request sharing a cached prefix
prefills only the rest, a conversation's later turns only their new tokens, and every
output equals a service's with --no-prefix-caching, token for token (greedy and seeded
sampling; plain, n-gram, draft model with lookahead; EAGLE-3 and DFlash in
tests/test_prefix_caching_features.py). Pages come back (none held after load, cached
ones counted apart), the cache gives way under page pressure, and requests racing for
one prefix agree.

One module-scoped set of services, started together: the reference (no prefix caching,
no draft), a draft model with its verify, an n-gram draft with a verify short of pages,
an EAGLE-3 draft with its verify (whose plain requests are the plain case). Lossless rests on the CPU reference being batch-
and chunk-invariant (tests/test_chunked_prefill.py: chunks give the tokens of one
forward; tests/test_batch_invariance.py).
"""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

import services
from parallel_services import free_port
from prom import scrape, value
from treespec.common.client import TreespecClient

BS = 16                 # the services' default --block-size
PREFIX = 600
TURNS = 5
NEW = 40                # user tokens a later turn adds
MAX_TOKENS = 8
METRICS = re.compile(r"metrics on (http://\S+/metrics)")
SAMPLED = {"temperature": 0.8, "seed": 11}


def tokens(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, 1000) for _ in range(n)]


def metrics(svc) -> dict:
    return scrape(METRICS.search(svc.output()).group(1))


@pytest.fixture(scope="module")
def svc():
    model, ngram, eagle = free_port(), free_port(), free_port()
    common = ("--metrics-port", "0", "--speculation", "always", "--step-deadline-ms", "3000")
    argv = [
        services.verify_argv("tiny-code", "--no-prefix-caching", "--metrics-port", "0"),
        services.draft_argv("model", "--metrics-port", "0", "--lookahead", "2",
                            model="tiny-code-draft", port=model),
        services.verify_argv("tiny-code", *common, draft=f"127.0.0.1:{model}"),
        services.draft_argv("ngram", port=ngram),
        services.verify_argv("tiny-code", *common, "--num-blocks", "100",
                             draft=f"127.0.0.1:{ngram}"),
        services.draft_argv("eagle3", "--target-embeddings", "tiny-code",
                            model="tiny-code-eagle3", port=eagle),
        services.verify_argv("tiny-code", *common, draft=f"127.0.0.1:{eagle}"),
    ]
    with services.at_once(*argv) as procs:
        ref, dmodel, vmodel, _, vngram, _, veagle = procs
        for v in (vmodel, vngram, veagle):
            services.wait_draft_connected(v)
        clients = {name: TreespecClient(p.addr) for name, p in
                   (("ref", ref), ("model", vmodel), ("ngram", vngram), ("eagle3", veagle))}
        yield {"clients": clients, "procs": {"ref": ref, "model": vmodel, "ngram": vngram,
                                            "eagle3": veagle, "draft_model": dmodel}}
        for c in clients.values():
            c.close()


def generate(client: TreespecClient, prompt: list[int], case: str, seeded: bool = False):
    sampling = SAMPLED if seeded else {"temperature": 0.0}
    return client.generate(prompt_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True,
                           no_speculation=case == "plain", **sampling)


def assert_no_page_held(proc) -> None:
    m = metrics(proc)       # a finished request's pages return at the next iteration
    for _ in range(50):
        if value(m, "treespec:kv_pages_used") == 0:
            break
        m = metrics(proc)
    assert value(m, "treespec:kv_pages_used") == 0
    assert value(m, "treespec:kv_pages_cached") > 0      # counted apart, in _free


def test_a_shared_prefix_then_a_conversation_prefill_only_the_new_tokens(svc):
    """Two prompts sharing a PREFIX-token prefix, then a conversation on the second of
    TURNS turns (odd turns greedy, even ones seeded), on three services at once: the
    draft model's (with lookahead), the n-gram's and, decoding plain, EAGLE-3's. Every
    output equals the reference's; every later prompt prefills only what is past the
    last turn's KV. EAGLE-3's own speculating sequences reuse what its draft holds
    (tests/test_prefix_caching_features.py), with the same output."""
    cl = svc["clients"]
    runs = {"model": (cl["model"], "model"), "ngram": (cl["ngram"], "ngram"),
            "plain": (cl["eagle3"], "plain")}
    prefix = tokens(1, PREFIX)
    first, second = prefix + tokens(2, 20), prefix + tokens(3, 25)
    prompt, before = second, 0
    with ThreadPoolExecutor(len(runs) + 1) as pool:
        def everywhere(p: list[int], seeded: bool = False) -> dict:
            jobs = {name: pool.submit(generate, c, p, case, seeded)
                    for name, (c, case) in runs.items()}
            want = generate(cl["ref"], p, "ref", seeded)
            got = {name: f.result() for name, f in jobs.items()}
            for name, g in got.items():
                assert g.token_ids == want.token_ids, name
            assert want.stats["cached_tokens"] == 0
            return got | {"ref": want}

        got = everywhere(first)
        assert all(g.stats["cached_tokens"] == 0 for g in got.values())
        for turn in range(TURNS):
            seeded = turn % 2 == 1
            got = everywhere(prompt, seeded)
            cached = {g.stats["cached_tokens"] for g in got.values() if g is not got["ref"]}
            if turn == 0:
                assert cached == {PREFIX // BS * BS}
            else:       # the last turn's KV (one token more where a cut path left it)
                assert cached <= {before // BS * BS, (before + 1) // BS * BS}, cached
                assert len(prompt) - min(cached) < NEW + BS
            if turn < 2:
                eagle = generate(cl["eagle3"], prompt, "eagle3", seeded)
                assert eagle.token_ids == got["ref"].token_ids
            before = len(prompt) + MAX_TOKENS - 1
            prompt = prompt + got["ref"].token_ids + tokens(10 + turn, NEW)
    for name in ("model", "ngram", "eagle3"):
        assert_no_page_held(svc["procs"][name])


def test_racing_requests_for_one_prefix_agree_and_the_draft_reuses_it(svc):
    c, ref = svc["clients"]["model"], svc["clients"]["ref"]
    dmodel, vmodel = svc["procs"]["draft_model"], svc["procs"]["model"]
    prefix = tokens(99, PREFIX)
    prompts = [prefix + tokens(100 + i, 10 + i) for i in range(4)]
    v0, d0 = metrics(vmodel), metrics(dmodel)
    with ThreadPoolExecutor(8) as pool:
        got = pool.map(lambda p: generate(c, p, "model"), prompts)
        want = pool.map(lambda p: generate(ref, p, "model"), prompts)
        got, want = list(got), list(want)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    # whoever ran first computed the prefix; the others raced it (then they computed
    # it too, into pages of their own) or found it
    assert all(g.stats["cached_tokens"] in (0, PREFIX // BS * BS) for g in got)
    v1 = metrics(vmodel)
    hits = sum(g.stats["cached_tokens"] for g in got)
    assert value(v1, "vllm:prefix_cache_hits_total") - \
        value(v0, "vllm:prefix_cache_hits_total") == hits
    assert value(v1, "vllm:prefix_cache_queries_total") - \
        value(v0, "vllm:prefix_cache_queries_total") == sum(map(len, prompts))
    again = generate(c, prefix + tokens(200, 30), "model")
    assert again.stats["cached_tokens"] == PREFIX // BS * BS
    d1 = metrics(dmodel)        # the draft model's own KV: a shared prefix, caught up once
    assert value(d1, "vllm:prefix_cache_hits_total") - \
        value(d0, "vllm:prefix_cache_hits_total") >= PREFIX // BS * BS
    assert_no_page_held(vmodel)


def test_cached_pages_give_way_under_page_pressure(svc):
    """100 pages of 16: a 600-token prompt's 38 pages stay cached until two others need
    the room (the least recently released go first); then it is computed again, with
    the same output."""
    c, ref, proc = svc["clients"]["ngram"], svc["clients"]["ref"], svc["procs"]["ngram"]
    prompt = tokens(500, PREFIX)
    first = generate(c, prompt, "ngram")
    assert generate(c, prompt, "ngram").stats["cached_tokens"] == (PREFIX - 1) // BS * BS
    for i in range(2):
        generate(c, tokens(600 + i, PREFIX), "ngram")
    after = generate(c, prompt, "ngram")
    assert after.stats["cached_tokens"] < (PREFIX - 1) // BS * BS
    assert after.token_ids == first.token_ids == generate(ref, prompt, "ngram").token_ids
    assert_no_page_held(proc)
