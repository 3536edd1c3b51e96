"""The EAGLE-3 proposer: its head over paged KV drafts exactly what the reference forward
of bench/train_tiny/eagle3.py drafts on the same tokens and features (level 1, a whole
chain, every tree edge, across incremental updates and batches), its trees are valid,
a checkpoint without embed_tokens loads from --target-embeddings and fails clearly
without it, and through real gRPC servers the output equals plain greedy while the
head reads the target's hidden states."""

from __future__ import annotations

import asyncio
import os
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from train_tiny import eagle3 as E
from treespec.common import cli
from treespec.common.client import AsyncTreespecClient
from treespec.common.serving.errors import InvalidRequest
from treespec.common.model.paths import SHIPPED_DIR
from treespec.common.spec.messages import SeqUpdate, SpecRequest
from treespec.common.spec.tree import PAD, PRESETS, ROOT, TreeEnvelope, validate_tree
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.eagle3_proposer import Eagle3Proposer
from treespec.draft_service.engine import DraftEngine
from inproc import greedy_reference, services
from tests_data import tp

AUX = [0, 1, 2]            # the 2-layer test target: embeddings, after layer 0, after layer 1
DRAFT_VOCAB = 64
HIDDEN = 64
C = len(AUX) * HIDDEN


def _draft_vocab(vocab: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:n].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids, ids - torch.arange(n), t2d


def _write_head(path: Path, target_dir: Path, draft_vocab: int, seed: int) -> Path:
    """A random head in the EAGLE-3 layout for the test target (weights widened so that
    its choices are not near-ties, norms random so that swapping two shows)."""
    tcfg = Qwen3Config.from_pretrained(target_dir)
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    cfg = E.head_config(tcfg, 2 * HIDDEN, draft_vocab, AUX, "float32")
    ids, d2t, t2d = _draft_vocab(tcfg.vocab_size, draft_vocab, seed)
    head = E.new_head(cfg, target, ids, d2t, t2d, seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name == "embed_tokens.weight":
                continue
            if p.dim() == 2:
                p.normal_(0, 0.2)
            else:
                p.uniform_(0.5, 1.5)
    E.save_head(head, path, torch.float32)
    return path


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, target_dir) -> Path:
    return _write_head(tmp_path_factory.mktemp("eagle3"), target_dir, DRAFT_VOCAB, seed=3)


@pytest.fixture(scope="module")
def no_embed_dir(tmp_path_factory, head_dir) -> Path:
    path = tmp_path_factory.mktemp("eagle3-no-embed")
    sd = load_file(str(head_dir / "model.safetensors"))
    del sd["embed_tokens.weight"]
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text((head_dir / "config.json").read_text())
    return path


def _proposer(path: Path, env: TreeEnvelope, **kw) -> Eagle3Proposer:
    kw = {"num_blocks": 64, "block_size": 4, **kw}
    return Eagle3Proposer.from_config(DraftConfig(method="eagle3", envelope=env,
                                                  model=str(path), device="cpu", **kw))


def _inputs(seed: int, n: int) -> tuple[list[int], torch.Tensor]:
    """Committed tokens s_0..s_n and the rows the verify service would send with them
    (row j = f_{j-1}, row 0 zeros): [n + 1], [n + 1, C]."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 96, (n + 1,), generator=g).tolist()
    rows = torch.randn(n + 1, C, generator=g)
    rows[0] = 0
    return tokens, rows


def _children(tokens: torch.Tensor, parents: torch.Tensor, node: int) -> list[int]:
    return [int(tokens[i]) for i in range(tokens.shape[0]) if int(parents[i]) == node]


def _ref_topk(ref: E.Eagle3Head, tokens: list[int], rows: torch.Tensor, path: list[int],
              k: int) -> list[int]:
    """The reference's top-k target ids after committed tokens + draft path."""
    n = len(tokens) - 1
    out, logits, cache = ref.step(torch.tensor([tokens[1:]]), rows[None, 1:], torch.arange(n))
    out, logits = out[:, -1:], logits[:, -1:]
    for i, t in enumerate(path):
        out, logits, cache = ref.step(torch.tensor([[t]]), out, torch.tensor([n + i]), cache)
    return ref.to_target(logits[0, -1].topk(k).indices).tolist()


def test_level1_tokens_are_the_reference_topk(head_dir):
    env = TreeEnvelope(depth=1, topk=3, num_nodes=3)
    prop = _proposer(head_dir, env)
    ref = E.load_head(head_dir)
    seqs = {s: _inputs(s, n) for s, n in ((1, 9), (2, 1), (3, 17))}
    for s, (toks, rows) in seqs.items():
        prop.update(s, toks, len(toks), [], rows)
    _tb = prop.propose(list(seqs))
    tokens, parents = _tb.tokens, _tb.parents
    assert validate_tree(tokens, parents, env.num_nodes, 96) is None
    for r, (toks, rows) in enumerate(seqs.values()):
        assert (parents[r] == ROOT).all()
        assert tokens[r].tolist() == _ref_topk(ref, toks, rows, [], 3)
    assert prop.target_hidden_layers == tuple(AUX) and prop.vocab_size == 96


def test_chain_equals_the_reference_chain_across_updates(head_dir):
    env = PRESETS["chain4"]
    prop = _proposer(head_dir, env)
    start = prop.cache.blocks.num_free           # all but the graphs' scratch page
    ref = E.load_head(head_dir)
    toks, rows = _inputs(7, 30)
    seen = 12
    prop.update(5, toks[:seen], seen, [], rows[:seen])
    for new in (3, 1, 0, 6, 1):        # 0: the same committed list again
        _tb = prop.propose([5])
        got, parents = _tb.tokens, _tb.parents
        want = ref.draft_chain(torch.tensor([toks[:seen]]), rows[None, 1:seen], env.depth)
        assert got[0].tolist() == want[0].tolist()
        assert parents[0].tolist() == [-1, 0, 1, 2]
        prop.update(5, toks[:seen + new], new, [0], rows[seen:seen + new])
        seen += new
    assert prop.cache.blocks.num_free < start
    prop.release(5)
    assert prop.cache.blocks.num_free == start


def test_many_steps_after_a_catch_up(head_dir):
    """A catch-up lands (and grows) a sequence's rows in the step's inference mode; the
    next FLUSH_AT one-token updates land outside it (the H100's b32 shadow rows, s24)."""
    from treespec.common.runtime.row_buffer import FLUSH_AT
    env, ref = PRESETS["chain4"], E.load_head(head_dir)
    prop = _proposer(head_dir, env, num_blocks=128)
    n = 92 + FLUSH_AT + 4
    toks, rows = _inputs(11, n)
    prop.update(3, toks[:80], 80, [], rows[:80])     # rows double on landing: room to spare
    prop.propose([3])
    prop.update(3, toks[:92], 12, [0], rows[80:92])                  # back from a rest
    for seen in range(92, n):
        prop.propose([3])
        prop.update(3, toks[:seen + 1], 1, [0], rows[seen:seen + 1])
    want = ref.draft_chain(torch.tensor([toks[:n]]), rows[None, 1:n], env.depth)
    assert prop.propose([3]).tokens[0].tolist() == want[0].tolist()


def test_out_of_pages_pads_the_row_and_catches_up_later(head_dir):
    env = PRESETS["chain4"]
    prop = _proposer(head_dir, env, num_blocks=5)      # a scratch page + 16 slots: 9 pairs
    ref = E.load_head(head_dir)
    (ta, ra), (tb, rb) = _inputs(41, 9), _inputs(42, 9)
    prop.update(1, ta, len(ta), [], ra)
    prop.update(2, tb[:6], 6, [], rb[:6])
    _tb = prop.propose([1, 2])
    got, parents = _tb.tokens, _tb.parents
    assert (parents[0] != PAD).all() and (parents[1] == PAD).all()
    prop.update(2, tb, 4, [], rb[6:])                   # B's rows wait for pages meanwhile
    prop.release(1)
    _tb = prop.propose([2])
    got, _ = _tb.tokens, _tb.parents
    want = ref.draft_chain(torch.tensor([tb]), rb[None, 1:], env.depth)
    assert got[0].tolist() == want[0].tolist()


def test_missing_hidden_states_count_as_zero_features(head_dir):
    env = PRESETS["chain4"]
    prop = _proposer(head_dir, env)
    ref = E.load_head(head_dir)
    toks, _ = _inputs(43, 8)
    prop.update(1, toks, len(toks), [], None)
    _tb = prop.propose([1])
    got, _ = _tb.tokens, _tb.parents
    want = ref.draft_chain(torch.tensor([toks]), torch.zeros(1, 8, C), env.depth)
    assert got[0].tolist() == want[0].tolist()


def test_every_tree_edge_is_in_the_reference_topk(head_dir):
    env = PRESETS["tree-small"]
    prop = _proposer(head_dir, env)
    ref = E.load_head(head_dir)
    seqs = {s: _inputs(10 + s, n) for s, n in ((1, 6), (2, 13))}
    for s, (toks, rows) in seqs.items():
        prop.update(s, toks, len(toks), [], rows)
    _tb = prop.propose(list(seqs))
    tokens, parents = _tb.tokens, _tb.parents
    assert validate_tree(tokens, parents, env.num_nodes, 96) is None
    assert (parents != PAD).all()
    for r, (toks, rows) in enumerate(seqs.values()):
        t, p = tokens[r], parents[r]
        assert int(t[0]) == _ref_topk(ref, toks, rows, [], 1)[0]    # the best node first
        for node in [ROOT] + list(range(env.num_nodes)):
            kids = _children(t, p, node)
            if not kids:
                continue
            path, up = [], node
            while up != ROOT:
                path.insert(0, int(t[up]))
                up = int(p[up])
            assert set(kids) <= set(_ref_topk(ref, toks, rows, path, env.topk)), (r, node)


def test_engine_info_and_hidden_width_check(head_dir):
    eng = DraftEngine(DraftConfig(method="eagle3", envelope=PRESETS["chain4"],
                                  model=str(head_dir), device="cpu"))
    assert eng.info.target_hidden_layers == tuple(AUX) and eng.info.proposer == "eagle3"
    assert eng.info.vocab_size == 96
    assert eng.info.projected_width == eng.proposer.projection.shape[0] == HIDDEN
    bad = SeqUpdate(1, committed_len=3, new_tokens=[1, 2, 3], full=True,
                    hidden=torch.zeros(3, C - 1))
    with pytest.raises(InvalidRequest, match="hidden states"):
        eng.step(SpecRequest(step_id=1, seqs=[bad]))


def test_checkpoint_without_embeddings_takes_the_targets(no_embed_dir, head_dir, target_dir,
                                                         tmp_path):
    env = PRESETS["tree-small"]
    with pytest.raises(ValueError, match="--target-embeddings"):
        _proposer(no_embed_dir, env)
    emb_file = tmp_path / "embed.safetensors"
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    save_file({"model.embed_tokens.weight": target.model.embed_tokens.weight.contiguous()},
              str(emb_file))
    toks, rows = _inputs(21, 11)
    trees = []
    for path, kw in ((head_dir, {}), (no_embed_dir, {"target_embeddings": str(target_dir)}),
                     (no_embed_dir, {"target_embeddings": str(emb_file)})):
        prop = _proposer(path, env, **kw)
        prop.update(1, toks, len(toks), [], rows)
        trees.append(tp(prop.propose([1])))
    for t, p in trees[1:]:
        assert torch.equal(t, trees[0][0]) and torch.equal(p, trees[0][1])


def test_cli_refuses_a_head_without_embeddings_at_start(no_embed_dir, target_dir, monkeypatch,
                                                        capsys):
    seen = {}
    monkeypatch.setattr(cli, "run_server", lambda module, cfg: seen.update(cfg=cfg))
    argv = ["draft", "--method", "eagle3", "--model", str(no_embed_dir), "--port", "0"]
    assert cli.main(argv) == 2
    assert "--target-embeddings" in capsys.readouterr().err and not seen
    assert cli.main(argv + ["--target-embeddings", str(no_embed_dir)]) == 2
    assert "holds no model.embed_tokens.weight" in capsys.readouterr().err
    assert cli.main(argv + ["--target-embeddings", str(target_dir)]) == 0
    assert seen["cfg"].target_embeddings == str(target_dir)


PROMPTS = [[1, 5, 9, 13, 2, 7, 1, 5, 9, 13], [3, 4, 5, 6], [10, 20, 30, 40, 50, 60, 70]]
MAX_TOKENS = 20


async def _generate(target, head, envelope, draft_socket="auto"):
    """Outputs, whether the verify KV came back, every update the proposer saw and
    its projection. On the local socket (draft_socket auto) hidden states cross in
    the connection's shared buffer, over gRPC in the messages."""
    seen: list[tuple[list[int], int, torch.Tensor | None]] = []
    async with services(target, "eagle3", head, envelope, draft_socket=draft_socket) as h:
        assert h["engine"].link.info.target_hidden_layers == tuple(AUX)
        shared = h["engine"].link.sync.shared
        assert (shared is not None) == (draft_socket == "auto")
        prop = h["draft_engine"].proposer
        update = prop.update

        def spy(seq_id, tokens, new_count, accepted, hidden):
            seen.append((list(tokens), new_count, None if hidden is None else hidden.clone()))
            update(seq_id, tokens, new_count, accepted, hidden)
        prop.update = spy
        async with AsyncTreespecClient(h["addr"]) as c:
            outs = [await c.generate(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True)
                    for p in PROMPTS]
        if shared is not None:         # unlinked once the first request came
            assert not os.path.exists(shared.path)
        return outs, h["engine"].kv_pages_used == 0, seen, prop.projection


def _check_rows(target_dir, seen, projection) -> None:
    """Each new token s_j came with f_{j-1}, the aux layers' states at s_{j-1} (our Qwen3
    on the whole committed list; s_0 gets zeros), through the head's projection (the
    verify fetched it when the draft connected)."""
    from treespec.common.runtime.forward_batch import build_forward_batch, chain_chunk
    from treespec.common.runtime.kv_cache import SeqPages
    from treespec.common.model.qwen3 import Qwen3Model
    from treespec.kernels import reference as ops
    model = Qwen3Model.from_pretrained(target_dir)
    for tokens, new, hidden in seen:
        assert hidden is not None and hidden.shape == (new, HIDDEN)
        cache = model.new_cache(64, 4)
        fb = build_forward_batch([chain_chunk(SeqPages(), tokens)], cache)
        feats = torch.cat(model(fb, cache, ops, tuple(AUX))[1], -1)          # [L, C]
        want = torch.cat([torch.zeros(1, C), feats])[len(tokens) - new:len(tokens)]
        torch.testing.assert_close(hidden.float(), want @ projection.float().T,
                                   atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("envelope, draft_socket", [("chain4", "auto"), ("tree-small", "auto"),
                                                    ("chain4", "off")])
def test_speculative_greedy_equals_plain_greedy(target_dir, head_dir, envelope, draft_socket):
    outs, all_free, seen, proj = asyncio.run(_generate(target_dir, head_dir, envelope,
                                                       draft_socket))
    for p, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_reference(target_dir, p, MAX_TOKENS)
        assert out.stats["draft_tokens"] > 0 and out.stats["fallback_steps"] == 0
    assert all_free
    _check_rows(target_dir, seen, proj)


SHIPPED_HEAD = SHIPPED_DIR / "tiny-code-eagle3"


@pytest.mark.skipif(not (SHIPPED_HEAD / "config.json").exists(),
                    reason="the shipped tiny-code-eagle3 checkpoint is not there yet")
@pytest.mark.parametrize("envelope", ["chain4", "tree-small"])
def test_shipped_head_speculates_on_the_shipped_target(envelope):
    target = SHIPPED_DIR / "tiny-code"
    aux = json.loads((SHIPPED_HEAD / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target)
    prompt = tok.encode("import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n")

    async def go():
        async with services(target, "eagle3", SHIPPED_HEAD, envelope) as h:
            assert h["engine"].link.info.target_hidden_layers == tuple(aux)
            async with AsyncTreespecClient(h["addr"]) as c:
                return await c.generate(prompt_ids=prompt, max_tokens=32, ignore_eos=True)
    out = asyncio.run(go())
    assert out.token_ids == greedy_reference(target, prompt, 32)
    s = out.stats
    assert (s["accepted_tokens"] + s["steps"]) / s["steps"] > 1.5
