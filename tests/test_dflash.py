"""The DFlash proposer: a checkpoint in z-lab's layout loads (a config or tensor that
does not fit is named), its paged block forward drafts exactly what the dense forward
of bench/train_tiny/dflash.py drafts on the same tokens and target features (across
incremental updates and a batch), its trees keep to the block's marginals, and through
real gRPC servers (both carriers) the output equals plain greedy."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from train_tiny import dflash as D
from treespec.common import cli
from treespec.common.model.checkpoint import CheckpointError, load_state_dict
from treespec.common.client import AsyncTreespecClient
from treespec.common.runtime.forward_batch import build_forward_batch, chain_chunk
from treespec.common.runtime.kv_cache import SeqPages
from treespec.common.model.paths import SHIPPED_DIR
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.spec.sampling import GREEDY, SamplingParams, as_tensors
from treespec.common.spec.tree import PRESETS, ROOT, envelope_from, validate_tree
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.dflash_proposer import DFlashProposer, _greedy_tree, block_tree
from inproc import greedy_reference, services
from treespec.kernels import reference as ops
from tests_data import tp
from checkpoints import make_checkpoint

LAYER_IDS = [0, 2]            # of a 4-layer target: capture indices 1 and 3
BLOCK = 8


@pytest.fixture(scope="module")
def target4(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("target4"), seed=4, layers=4, hidden=64,
                           heads=4, kv_heads=2, shard=True, tie=False)


def write_drafter(path: Path, target: Path, layer_ids: list[int], seed: int) -> Path:
    """A random drafter in z-lab's layout (attention weights wide, so that the block's
    positions, which differ only by position, draft different tokens; norms random so
    that swapping two shows)."""
    tcfg = json.loads((target / "config.json").read_text())
    cfg = D.drafter_config(tcfg, layers=2, block_size=BLOCK,
                           mask_token_id=tcfg["vocab_size"] - 1, layer_ids=layer_ids)
    torch.manual_seed(seed)
    model = D.DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            wide = "_proj" in name and "mlp" not in name or name == "fc.weight"
            p.normal_(0, 1.0 if wide else 0.25) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    D.save_drafter(model, path, torch.float32)
    return path


@pytest.fixture(scope="module")
def dflash_dir(tmp_path_factory, target4) -> Path:
    return write_drafter(tmp_path_factory.mktemp("dflash"), target4, LAYER_IDS, seed=7)


@pytest.fixture(scope="module")
def dflash_small(tmp_path_factory, target_dir) -> Path:
    """A drafter for the 2-layer test target (the sampling and coupled tests' target)."""
    return write_drafter(tmp_path_factory.mktemp("dflash-small"), target_dir, [0], seed=8)


def _proposer(path: Path, target: Path, env: str) -> DFlashProposer:
    return DFlashProposer.from_config(DraftConfig(
        method="dflash", envelope=PRESETS[env], model=str(path),
        target_embeddings=str(target), device="cpu", num_blocks=64, block_size=4))


def _features(target: Path, tokens: list[int], layer_ids: list[int] = LAYER_IDS
              ) -> torch.Tensor:
    """f_0 .. f_{n-1} at the drafter's capture indices, [len(tokens), F] (the last row,
    the root's, is what the verify sends with the next token)."""
    model = Qwen3Model.from_pretrained(target)
    cache = model.new_cache(64, 4)
    fb = build_forward_batch([chain_chunk(SeqPages(), tokens)], cache)
    return torch.cat(model(fb, cache, ops, tuple(i + 1 for i in layer_ids))[1], -1)


def _oracle(path: Path, target: Path, tokens: list[int], feats: torch.Tensor) -> torch.Tensor:
    """The dense forward's marginals [B - 1, V] after committed tokens."""
    model = D.DFlashDrafter(json.loads((path / "config.json").read_text()))
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    tsd = load_state_dict(target, names={"model.embed_tokens.weight", "lm_head.weight"})
    n = len(tokens) - 1
    block = torch.tensor([[tokens[-1]] + [model.mask_token_id] * (BLOCK - 1)])
    with torch.no_grad():
        logits = model(feats[None, :n], torch.tensor([[n]]), block[None],
                       tsd["model.embed_tokens.weight"], tsd["lm_head.weight"])
    return logits[0, 0]


def test_block_chain_equals_the_dense_forward(dflash_dir, target4):
    """Chains of the block's argmax, for a batch of two sequences, then again after each
    grows by a few committed tokens (the new pairs' context K/V in the step)."""
    prop = _proposer(dflash_dir, target4, "block8")
    assert prop.target_hidden_layers == (1, 3) and prop.env.depth == BLOCK - 1
    g = torch.Generator().manual_seed(3)
    seqs = {1: torch.randint(0, 95, (11,), generator=g).tolist(),
            2: torch.randint(0, 95, (5,), generator=g).tolist()}
    sent = {s: 0 for s in seqs}
    drafted, chains = set(), []
    for grow in (0, 3, 9):
        for s in seqs:
            seqs[s] = seqs[s] + torch.randint(0, 95, (grow,), generator=g).tolist()
            f = _features(target4, seqs[s])
            rows = torch.cat([torch.zeros(1, f.shape[1]), f])[sent[s]:len(seqs[s])]
            prop.update(s, seqs[s], len(seqs[s]) - sent[s], [], rows)
            sent[s] = len(seqs[s])
        tokens, parents = tp(prop.propose([1, 2]))
        for r, s in enumerate(seqs):
            want = _oracle(dflash_dir, target4, seqs[s], _features(target4, seqs[s]))
            assert tokens[r].tolist() == want.argmax(-1).tolist(), (grow, s)
            assert parents[r].tolist() == list(range(-1, BLOCK - 2))
            drafted |= set(tokens[r].tolist())
            chains.append(tokens[r].tolist())
    # not one token everywhere: within a chain, positions draft different tokens
    assert len(drafted) >= 6 and all(len(set(c)) > 1 for c in chains[:3])


def test_trees_choose_among_each_positions_best(dflash_dir, target4):
    env = PRESETS["tree-small"]
    prop = _proposer(dflash_dir, target4, "tree-small")
    toks = torch.randint(0, 95, (13,), generator=torch.Generator().manual_seed(8)).tolist()
    f = _features(target4, toks)
    prop.update(1, toks, len(toks), [], torch.cat([torch.zeros(1, f.shape[1]), f])[:len(toks)])
    tokens, parents = tp(prop.propose([1]))
    assert validate_tree(tokens, parents, env.num_nodes, 96) is None
    top = _oracle(dflash_dir, target4, toks, f).topk(env.topk, -1).indices
    for i in range(env.num_nodes):
        depth, up = 0, i
        while up != ROOT:
            depth, up = depth + 1, int(parents[0, up])
        assert int(tokens[0, i]) in top[depth - 1].tolist()
    assert int(tokens[0, 0]) == int(top[0, 0])          # best first: the argmax chain


def test_a_shallower_budget_takes_the_first_positions(dflash_dir, target4):
    """Asked for depth 3 of block8 (the verify's budget), the block drafts the same
    first three positions and nothing deeper; the whole block again afterwards."""
    from treespec.common.spec.tree import PAD
    prop = _proposer(dflash_dir, target4, "block8")
    toks = torch.randint(0, 95, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    f = _features(target4, toks)
    prop.update(1, toks, len(toks), [], torch.cat([torch.zeros(1, f.shape[1]), f])[:len(toks)])
    whole = tp(prop.propose([1]))
    t, par = tp(prop.propose([1], depth=3))
    assert t[0, :3].tolist() == whole[0][0, :3].tolist() and t.shape == whole[0].shape
    assert par[0].tolist() == [-1, 0, 1] + [PAD] * (BLOCK - 4)
    assert tp(prop.propose([1]))[0].tolist() == whole[0].tolist()


def test_bad_checkpoints_and_flags_are_named(dflash_dir, target4, tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="drafts 7 positions"):
        _proposer(dflash_dir, target4, "block16")
    cfg = json.loads((dflash_dir / "config.json").read_text())
    broken = tmp_path / "broken"
    broken.mkdir()
    sd = load_file(str(dflash_dir / "model.safetensors"))
    del sd["layers.1.self_attn.k_norm.weight"]
    save_file(sd, str(broken / "model.safetensors"))
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="layers.1.self_attn.k_norm.weight"):
        _proposer(broken, target4, "block8")
    assert cli.main(["draft", "--method", "dflash", "--model", str(broken), "--port", "0",
                     "--device", "cpu", "--target-embeddings", str(target4)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("lacks tensor 'layers.1.self_attn.k_norm.weight'")
    assert not any("Traceback" in line for line in err)
    seen = {}
    monkeypatch.setattr(cli, "run_server", lambda module, c: seen.update(cfg=c))
    argv = ["draft", "--method", "dflash", "--model", str(dflash_dir), "--port", "0"]
    assert cli.main(argv) == 2 and "--target-embeddings" in capsys.readouterr().err
    bad = dict(cfg, dflash_config=dict(cfg["dflash_config"], target_layer_ids=[0, 4]))
    (broken / "config.json").write_text(json.dumps(bad))
    assert cli.main(["draft", "--method", "dflash", "--model", str(broken), "--port", "0",
                     "--target-embeddings", str(target4)]) == 2
    assert "target_layer_ids [4] outside 0 .. 3" in capsys.readouterr().err and not seen
    assert cli.main(argv + ["--target-embeddings", str(target4)]) == 0
    assert seen["cfg"].envelope.name == "block8-tree"    # its block's tree, by default


def test_the_target_s_last_layer_is_a_layer_id(target4, tmp_path, monkeypatch):
    """z-lab's id i is transformers' hidden_states[i + 1], the last layer's (the final-
    normed output) included: a drafter naming layer 3 of a 4-layer target loads from
    the CLI, asks for capture index 4, is sent what transformers computes there, and
    drafts what the dense forward drafts from it."""
    from transformers import Qwen3ForCausalLM
    path = write_drafter(tmp_path / "last", target4, [1, 3], seed=9)
    seen = {}
    monkeypatch.setattr(cli, "run_server", lambda module, c: seen.update(cfg=c))
    assert cli.main(["draft", "--method", "dflash", "--model", str(path), "--port", "0",
                     "--target-embeddings", str(target4)]) == 0 and seen
    prop = _proposer(path, target4, "block8")
    assert prop.target_hidden_layers == (2, 4)
    toks = torch.randint(0, 95, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    f = _features(target4, toks, [1, 3])
    hf = Qwen3ForCausalLM.from_pretrained(target4, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([toks]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(f, torch.cat([hs[2][0], hs[4][0]], -1), atol=1e-4, rtol=1e-4)
    prop.update(1, toks, len(toks), [], torch.cat([torch.zeros(1, f.shape[1]), f])[:len(toks)])
    tokens, _ = tp(prop.propose([1]))
    assert tokens[0].tolist() == _oracle(path, target4, toks, f).argmax(-1).tolist()

    async def go():
        async with services(target4, "dflash", path, "block8",
                            draft_kw={"target_embeddings": str(target4)}) as h:
            assert h["engine"].link.info.target_hidden_layers == (2, 4)
            async with AsyncTreespecClient(h["addr"]) as c:
                return await c.generate(prompt_ids=PROMPTS[0], max_tokens=16, ignore_eos=True)
    out = asyncio.run(go())
    assert out.token_ids == greedy_reference(target4, PROMPTS[0], 16)
    assert out.stats["draft_tokens"] > 0 and out.stats["fallback_steps"] == 0


def test_greedy_tree_holds_the_best_paths_by_summed_log_prob():
    """A greedy DFlash tree is the best num_nodes of every path over each position's
    top-k (brute force here: 8 nodes never need 3 deviations from the argmax chain, so
    the tree must be exactly these), each parent an earlier node."""
    torch.manual_seed(3)
    logits = torch.randn(5, 4, 20)
    tokens, parents = _greedy_tree(logits, envelope_from(depth=4, topk=3, num_nodes=8),
                                   ops)
    lp, top = logits.log_softmax(-1), logits.topk(3, -1).indices
    for b in range(5):
        paths = [p for n in range(1, 5) for p in itertools.product(range(3), repeat=n)]
        score = {p: sum(lp[b, i, top[b, i, c]].item() for i, c in enumerate(p)) for p in paths}
        want = {tuple(top[b, i, c].item() for i, c in enumerate(p))
                for p in sorted(paths, key=score.get, reverse=True)[:8]}
        got = set()
        for n in range(8):
            assert parents[b, n] < n
            path, at = [], n
            while at >= 0:
                path, at = [tokens[b, at].item()] + path, parents[b, at].item()
            got.add(tuple(path))
        assert got == want


def test_a_sampling_rows_tree_has_one_shape_whatever_it_drew():
    """A sampling row's nodes score by their pick's rank (as tree_build.Expansion's
    static rows), so its tree's parents are the same whatever the logits and the draw;
    a rejection row's node is among its q's ids (its position's); a greedy row beside
    them gets the greedy tree."""
    env = envelope_from(depth=4, topk=3, num_nodes=8)
    params = [SamplingParams(temperature=0.8, seed=5),
              SamplingParams(temperature=1.2, top_k=10, seed=9), GREEDY]
    sampling = [*as_tensors(params, torch.device("cpu")), torch.tensor([True, False, False]),
                -1]
    shapes = set()
    for seed in range(3):
        logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(seed))
        tokens, parents, q_ids, q_probs = block_tree(logits, env, torch.tensor([7, 3, 5]),
                                                     sampling, ops)
        assert validate_tree(tokens, parents, env.num_nodes, 50, q_ids, q_probs) is None
        shapes.add(tuple(parents[:2].flatten().tolist()))
        assert all(tokens[0, i] in q_ids[0, i] for i in range(env.num_nodes))
        want = _greedy_tree(logits[2:], env, ops)
        assert torch.equal(tokens[2:], want[0]) and torch.equal(parents[2:], want[1])
    assert len(shapes) == 1


PROMPTS = [[1, 5, 9, 13, 2, 7, 1, 5, 9, 13], [3, 4, 5, 6], [10, 20, 30, 40, 50, 60, 70]]


@pytest.mark.parametrize("envelope, draft_socket, cut", [
    ("block8", "auto", False), ("block8-tree", "auto", False), ("chain4", "off", False),
    ("block8", "auto", True), ("tree-small", "auto", True)])
def test_speculative_greedy_equals_plain_greedy(dflash_dir, target4, envelope, draft_socket,
                                                cut):
    """cut: the budgets cycle through depths 1, 2, the block's and plain (the controller
    test's double), so the draft's shallower graphs serve too."""
    from test_budget_lossless import Cycling

    async def go():
        async with services(target4, "dflash", dflash_dir, envelope, draft_socket=draft_socket,
                            draft_kw={"target_embeddings": str(target4)}) as h:
            assert h["engine"].link.info.target_hidden_layers == (1, 3)
            if cut:
                h["engine"].controller.plan = Cycling(h["engine"].controller).plan
            async with AsyncTreespecClient(h["addr"]) as c:
                outs = [await c.generate(prompt_ids=p, max_tokens=24, ignore_eos=True)
                        for p in PROMPTS]
            if cut:
                families = {k[0] for k in h["draft_engine"].proposer.graphs.buckets.graphs}
                assert {("step", 1), ("step", 2), "step"} <= families, families
            return outs, h["engine"].kv_pages_used
    outs, used = asyncio.run(go())
    for p, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_reference(target4, p, 24)
        assert out.stats["draft_tokens"] > 0
        assert out.stats["fallback_steps"] == 0 or cut        # the cycle's plain steps
    assert used == 0


def test_training_rows_hold_independent_blocks(dflash_dir, target4):
    """bench/train_tiny/dflash.py puts several blocks in one row (each sees the context
    before its anchor and itself): the same logits as one block a row."""
    model = D.DFlashDrafter(json.loads((dflash_dir / "config.json").read_text()))
    model.load_state_dict(load_file(str(dflash_dir / "model.safetensors")))
    toks = torch.randint(0, 95, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    f = _features(target4, toks)[None]
    emb, head = torch.randn(96, 64), torch.randn(96, 64)
    blocks = torch.tensor([[toks[5]] + [95] * (BLOCK - 1), [toks[17]] + [95] * (BLOCK - 1)])
    with torch.no_grad():
        both = model(f, torch.tensor([[5, 17]]), blocks[None], emb, head)[0]
        for i, a in enumerate((5, 17)):
            one = model(f[:, :a], torch.tensor([[a]]), blocks[None, i:i + 1], emb, head)[0, 0]
            torch.testing.assert_close(both[i], one, atol=1e-4, rtol=1e-4)


def test_training_acceptance_follows_the_served_walk():
    """The training report's tokens a step: each step starts where the last one's commits
    end, as serving's do, not the mean over every anchor (which here would be 25 / 6)."""
    assert D.walk(torch.tensor([[3, 9, 9, 1, 2, 1], [1, 16, 1, 1, 1, 1]])) == (6 + 17) / (3 + 2)


SHIPPED = SHIPPED_DIR / "tiny-code-dflash"


@pytest.mark.skipif(not (SHIPPED / "config.json").exists(),
                    reason="the shipped tiny-code-dflash checkpoint is not there")
def test_shipped_drafter_speculates_on_the_shipped_target():
    target = SHIPPED_DIR / "tiny-code"
    from transformers import AutoTokenizer
    prompt = AutoTokenizer.from_pretrained(target).encode(
        "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n")

    async def go():
        async with services(target, "dflash", SHIPPED, "block16-tree",
                            draft_kw={"target_embeddings": "tiny-code"}) as h:
            async with AsyncTreespecClient(h["addr"]) as c:
                return await c.generate(prompt_ids=prompt, max_tokens=32, ignore_eos=True)
    out = asyncio.run(go())
    assert out.token_ids == greedy_reference(target, prompt, 32)
    s = out.stats
    assert (s["accepted_tokens"] + s["steps"]) / s["steps"] > 1.5
