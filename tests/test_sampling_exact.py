"""Sampled output follows the target's exact distribution, with speculation on.

Through both services (real gRPC servers) on the tiny random target: many seeded
requests, and per position a chi-square test of the tokens drawn against the exact
marginal that transformers' own model and logits warpers give (position k summed over
every prefix), for several temperature / top-k / top-p / min-p settings; Benjamini-
Hochberg at q = 0.05 over all of them; for rejection sampling with both model
drafters and for coupled acceptance. The same test on a deliberately biased acceptor
of each kind must reject: the test has the power to see a wrong implementation.
"""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
from tokenizers import Tokenizer
from transformers import Qwen3ForCausalLM
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from treespec.common.client import AsyncTreespecClient
from treespec.common.model.paths import resolve_model
from treespec.draft_service import dflash_proposer
from inproc import services
from treespec.kernels import reference
from test_dflash import dflash_small  # noqa: F401  (fixture)
from test_eagle3 import head_dir  # noqa: F401  (fixture)

PROMPT = [5, 17, 40, 2, 66, 9]
POSITIONS = 3                   # generated tokens tested: the prefill's and two steps'
SAMPLES = 600
# Fixed seeds make the test deterministic: with them the draws are the same on every
# run (and, coupled, with every drafter). At q = 0.05 about one set of seeds in twenty
# rejects a correct sampler by chance (1200 seeds from 1 do, at position 1, T 1: p = 0.0016;
# the same position with 20000 seeds gives p = 0.36); this set does not.
SEED0 = 10_001
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=12),
            dict(temperature=1.3, top_p=0.8, min_p=0.02)]


def warpers(s: dict) -> LogitsProcessorList:
    w = [TemperatureLogitsWarper(s["temperature"])]
    if s.get("top_k"):
        w.append(TopKLogitsWarper(s["top_k"]))
    if s.get("top_p", 1.0) < 1.0:
        w.append(TopPLogitsWarper(s["top_p"]))
    if s.get("min_p"):
        w.append(MinPLogitsWarper(s["min_p"]))
    return LogitsProcessorList(w)


def exact_marginals(target_dir, s: dict, prompt: list[int] = PROMPT) -> list[torch.Tensor]:
    """P(token at generated position k) for k = 1..POSITIONS, summed over prefixes.
    Computed once per checkpoint, setting and prompt (seconds each: every prefix of
    the first positions goes through transformers) and shared by every case and control
    that tests against it."""
    return _exact_marginals(str(target_dir), tuple(sorted(s.items())), tuple(prompt))


@functools.cache
@torch.no_grad()
def _exact_marginals(target_dir: str, setting: tuple, prompt: tuple[int, ...]
                     ) -> list[torch.Tensor]:
    s, prompt = dict(setting), list(prompt)
    model = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prefixes = torch.tensor([prompt])                      # every prefix so far
    weight = torch.ones(1, dtype=torch.float64)            # and its probability
    out = []
    for _ in range(POSITIONS):
        logits = model(prefixes).logits[:, -1].float()
        p = torch.softmax(warpers(s)(prefixes, logits), -1).double()      # [P, V]
        joint = weight.unsqueeze(1) * p
        out.append(joint.sum(0))
        v = p.shape[1]
        prefixes = torch.cat([prefixes.repeat_interleave(v, 0),
                              torch.arange(v).repeat(prefixes.shape[0]).unsqueeze(1)], 1)
        weight = joint.reshape(-1)
        live = weight > 1e-12                               # prefixes that can happen
        prefixes, weight = prefixes[live], weight[live]
    return out


def chi_square_p(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Goodness of fit; cells expected fewer than 5 times are pooled."""
    n = counts.sum().item()
    exp = expected_p * n
    small = exp < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([exp[~small], exp[small].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def bh_rejects(pvalues: list[float], q: float = 0.05) -> int:
    """How many hypotheses Benjamini-Hochberg rejects at false-discovery rate q."""
    ranked = sorted(pvalues)
    return max((i + 1 for i, p in enumerate(ranked) if p <= q * (i + 1) / len(ranked)),
               default=0)


async def _draws(target_dir, draft, method: str, s: dict, acceptance: str,
                 envelope: str, prompt: list[int]) -> list[list[int]]:
    kw = {"target_embeddings": str(target_dir)} if method == "dflash" else {}
    async with services(target_dir, method, draft, envelope, max_batch=64, num_blocks=2048,
                        acceptance=acceptance, draft_kw=kw) as h:
        async with AsyncTreespecClient(h["addr"]) as c:
            outs = []
            for first in range(SEED0, SEED0 + SAMPLES, 300):
                outs += await asyncio.gather(*[
                    c.generate(prompt_ids=prompt, max_tokens=POSITIONS, ignore_eos=True,
                               seed=seed, **s) for seed in range(first, first + 300)])
            assert sum(o.stats["accepted_tokens"] for o in outs) > 0
            return [o.token_ids for o in outs]


def pvalues(target_dir, draft, method: str, acceptance: str, envelope: str,
            settings: list[dict], prompt: list[int] = PROMPT) -> list[float]:
    out = []
    for s in settings:
        draws = torch.tensor(asyncio.run(_draws(target_dir, draft, method, s, acceptance,
                                                envelope, prompt)))
        for k, p in enumerate(exact_marginals(target_dir, s, prompt)):
            out.append(chi_square_p(torch.bincount(draws[:, k], minlength=p.shape[0]), p))
    return out


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Client, verify and draft share this process, each forward on its own thread: at
    one intra-op thread each they do not crowd two cores (the draws are the same)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Rejection sampling on trees (siblings drawn without replacement) and chains with the
# model drafters; coupled acceptance with them too, one setting each: its tokens are plain
# decode's under the same seeds with every drafter (tests/test_coupled_drafting.py).
# The n-gram proposer's nodes carry no q (one-hot): they are accepted as in coupled
# acceptance, which is exact for any proposal made without the target's noise.
# DFlash's rejection sampling on a tree is the trained drafter's test below (the random
# dflash_small has ~1 % of its nodes accepted: too few for a tree's q to show).
CASES = [("model", "rejection", "tree-small", SETTINGS),
         ("eagle3", "rejection", "tree-small", SETTINGS[:1]),
         ("model", "coupled", "chain4", SETTINGS[2:]),
         ("eagle3", "coupled", "tree-small", SETTINGS[1:2]),
         ("dflash", "coupled", "block8", SETTINGS[:1]),
         ("eagle3", "rejection", "chain4", SETTINGS[2:]),     # chains: each level's first pick
         ("dflash", "rejection", "block8", SETTINGS[1:2])]


@pytest.mark.parametrize("method,acceptance,envelope,settings", CASES,
                         ids=[f"{m}-{a}-{e}" for m, a, e, _ in CASES])
def test_speculative_samples_follow_the_exact_distribution(target_dir, draft_dir, head_dir,
                                                           dflash_small, method, acceptance,
                                                           envelope, settings):
    """The drafter proposes at every step and some of its nodes are accepted."""
    draft = {"eagle3": head_dir, "dflash": dflash_small}.get(method, draft_dir)
    assert bh_rejects(pvalues(target_dir, draft, method, acceptance, envelope, settings)) == 0


def test_the_test_rejects_a_biased_coupled_acceptor(target_dir, draft_dir, monkeypatch):
    """It takes the draft's first token at the root one time in five, whatever the
    target drew."""
    real = reference.accept_greedy
    g = torch.Generator().manual_seed(0)

    def biased(tokens, parents, target_ids, depth):
        take = (torch.rand(tokens.shape[0], generator=g) < 0.2) & (parents[:, 0] == -1)
        target_ids = target_ids.clone()
        target_ids[:, 0] = torch.where(take, tokens[:, 0].to(target_ids.dtype), target_ids[:, 0])
        return real(tokens, parents, target_ids, depth)
    monkeypatch.setattr(reference, "accept_greedy", biased)
    assert bh_rejects(pvalues(target_dir, draft_dir, "model", "coupled", "chain4",
                              SETTINGS[:1])) > 0


def test_the_test_rejects_rejection_sampling_without_the_check(target_dir, draft_dir,
                                                               monkeypatch):
    """Every acceptance uniform 0: a drafted token with any target mass is accepted,
    min(1, p / q) unchecked."""
    monkeypatch.setattr(reference, "accept_uniforms",
                        lambda seed, position, siblings: torch.zeros(seed.shape[0], siblings))
    assert bh_rejects(pvalues(target_dir, draft_dir, "model", "rejection", "tree-small",
                              SETTINGS[:1])) > 0


def shipped_dflash_pvalues() -> list[float]:
    """Rejection sampling on DFlash's default tree (block16-tree) with the shipped
    tiny-code target and its trained drafter, on code: about half the drafted positions
    are accepted there, where dflash_small (random) has ~1 % accepted, too few for a
    wrong q to show."""
    target, draft = resolve_model("tiny-code"), resolve_model("tiny-code-dflash")
    prompt = Tokenizer.from_file(str(target / "tokenizer.json")).encode(
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\ndef").ids
    return pvalues(target, draft, "dflash", "rejection", "block16-tree", SETTINGS[1:2], prompt)


def test_a_trained_dflash_trees_samples_follow_the_exact_distribution():
    assert bh_rejects(shipped_dflash_pvalues()) == 0


def test_the_test_rejects_a_dflash_tree_with_the_wrong_q(monkeypatch):
    """Each node's q flattened (its square root; the verify renormalizes it): not the
    distribution the draft drew the node's siblings from."""
    real = dflash_proposer.block_tree

    def flattened(*a):
        t = real(*a)
        return (*t[:3], t[3].sqrt()) if len(t) == 4 else t
    monkeypatch.setattr(dflash_proposer, "block_tree", flattened)
    assert bh_rejects(shipped_dflash_pvalues()) > 0
