"""bench/train_tiny.py: a CPU smoke run through the CLI, then the properties its three
checkpoints must have — loadable tokenizers and Qwen3 models, the EAGLE-3 layout that
SGLang and vLLM load, consistent d2t/t2d, a held-out split that training never saw, and an
EAGLE-3 training forward (TTT) equal to the inference forward it stands for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen3ForCausalLM

from train_tiny import corpus as C
from train_tiny import eagle3 as E
from train_tiny.distill import TargetTap
from train_tiny.evaluate import accepted_lengths, draft_proposer, simulate
from treespec.common.model.config import Qwen3Spec

ROOT = Path(__file__).resolve().parents[1]
DIRS = ("tiny-code", "tiny-code-draft", "tiny-code-eagle3")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    # 4 steps a stage: the pipeline end to end, not a trained family (30 steps ran into
    # the budget and were cut to fit it, ~50 s; the properties below hold at any step)
    cmd = [sys.executable, str(ROOT / "bench" / "train_tiny.py"), "--out", str(out),
           "--device", "cpu", "--tiny", "--max-files", "20", "--steps", "4",
           "--minutes-budget", "0.75"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "held-out greedy chain-4 eagle3" in proc.stdout
    return out


@pytest.fixture(scope="module")
def report(trained) -> dict:
    return json.loads((trained / "TRAINING.json").read_text())


def test_every_directory_has_a_loadable_tokenizer(trained):
    text = "def f(x):\n    return x  # é\n"
    for d in DIRS:
        path = trained / d
        for f in ("config.json", "model.safetensors", "generation_config.json"):
            assert (path / f).exists(), f"{d}/{f}"
        tok = AutoTokenizer.from_pretrained(path)
        assert tok.eos_token == C.EOS and tok.eos_token_id == 0
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 0


def test_target_and_draft_load_as_qwen3(trained, report):
    for d, key in (("tiny-code", "target"), ("tiny-code-draft", "draft")):
        model = Qwen3ForCausalLM.from_pretrained(trained / d)
        n = sum(p.numel() for p in model.parameters())
        assert n == report["params"][key] == Qwen3Spec.from_dir(trained / d).num_params
        spec = Qwen3Spec.from_dir(trained / d)
        assert spec.eos_token_ids == (0,) and spec.max_position == 2048
        ids = torch.tensor([[5, 17, 99, 3]])
        assert model(input_ids=ids).logits.shape == (1, 4, spec.vocab_size)


def test_eagle3_config_and_tensor_layout(trained, report):
    path = trained / "tiny-code-eagle3"
    cfg = json.loads((path / "config.json").read_text())
    target = json.loads((trained / "tiny-code" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["vocab_size"] == target["vocab_size"]
    assert cfg["hidden_size"] == cfg["target_hidden_size"] == target["hidden_size"]
    assert cfg["tie_word_embeddings"] is False and cfg["num_hidden_layers"] == 1
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == sorted(set(ids)) and len(ids) == 3
    assert 2 <= ids[0] and ids[-1] <= target["num_hidden_layers"] - 1
    assert ids == report["eagle3"]["aux_layer_ids"]

    h, v, vd = cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"]
    q, kv, i = (cfg["num_attention_heads"] * cfg["head_dim"],
                cfg["num_key_value_heads"] * cfg["head_dim"], cfg["intermediate_size"])
    want = {"embed_tokens.weight": (v, h), "fc.weight": (h, 3 * h),
            "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (q, 2 * h),
            "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, q),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.mlp.gate_proj.weight": (i, h), "midlayer.mlp.up_proj.weight": (i, h),
            "midlayer.mlp.down_proj.weight": (h, i), "norm.weight": (h,),
            "lm_head.weight": (vd, h), "d2t": (vd,), "t2d": (v,)}
    with safe_open(str(path / "model.safetensors"), framework="pt") as st:
        got = {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}
        d2t, t2d = st.get_tensor("d2t"), st.get_tensor("t2d")
        embed = st.get_tensor("embed_tokens.weight")
    assert got == want
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool

    # d2t and t2d describe the same ascending set of vd target ids.
    target_ids = torch.arange(vd) + d2t
    assert bool((target_ids[1:] > target_ids[:-1]).all()) and int(target_ids.max()) < v
    assert int(t2d.sum()) == vd and bool(t2d[target_ids].all())
    # The head's embedding is the target's, so the layout also works without it.
    with safe_open(str(trained / "tiny-code" / "model.safetensors"), framework="pt") as st:
        assert torch.equal(embed, st.get_tensor("model.embed_tokens.weight"))


def test_held_out_files_never_trained_on(report):
    assert report["held_out_files"] == list(C.HELD_OUT)
    assert set(report["train_files"]).isdisjoint(C.HELD_OUT)
    assert len(report["train_files"]) == 20
    assert not any(part in ("test", "tests", "idle_test", "site-packages")
                   for f in report["train_files"] for part in f.split("/")[:-1])


def test_full_listing_excludes_tests_and_keeps_held_out():
    files = C.list_sources(C.stdlib_root())
    assert set(C.HELD_OUT) <= set(files) and files == sorted(files)
    assert not any(f.startswith(("test/", "idlelib/idle_test/", "lib2to3/tests/"))
                   for f in files)


def test_report_has_losses_acceptance_and_timings(report):
    for key in ("target", "draft"):
        assert report["held_out_loss"][key] > 0
    for name in ("draft", "eagle3"):
        acc = report["acceptance"][name]
        assert 1.0 <= acc["mean_tokens_per_step"] <= 5.0 and acc["steps"] > 0
    assert report["wall_seconds"]["total"] > 0
    assert report["corpus"]["train_tokens"] > 0


def test_head_loads_without_embedding_and_ttt_equals_inference_chain(trained):
    target = Qwen3ForCausalLM.from_pretrained(trained / "tiny-code", dtype=torch.float32).eval()
    full = E.load_head(trained / "tiny-code-eagle3")
    no_embed = E.load_head(trained / "tiny-code-eagle3",
                           embed=target.get_input_embeddings().weight.detach())
    assert torch.equal(full.embed_tokens.weight, no_embed.embed_tokens.weight)

    head = full
    torch.manual_seed(0)
    with torch.no_grad():  # sharpen the toy head so its greedy chain is not a constant
        for mod in head.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.normal_(0, 0.3)
    aux = head.cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    tap = TargetTap(target, aux)
    x = torch.randint(1, head.cfg["vocab_size"], (2, 24))
    _, feats = tap(x)
    hs = target(input_ids=x, output_hidden_states=True).hidden_states
    h = head.cfg["hidden_size"]
    for k, i in enumerate(aux):  # aux id i = residual stream entering layer i
        torch.testing.assert_close(feats[..., k * h:(k + 1) * h], hs[i])

    steps, t = 3, x.shape[1] - 1
    logits = head.unrolled(feats[:, :t], x[:, 1:], steps, greedy=True)
    parallel = torch.stack([head.to_target(lg.argmax(-1)) for lg in logits], dim=-1)
    for root in (0, 7, t - 1):
        chain = head.draft_chain(x[:, :root + 2], feats[:, :root + 1], steps)
        assert torch.equal(chain, parallel[:, root])
    # Logits too: step 1 of the chain at one root, by `step` with a KV cache.
    root = 9
    out, lg0, cache = head.step(x[:, 1:root + 2], feats[:, :root + 1], torch.arange(root + 1))
    torch.testing.assert_close(lg0[:, -1], logits[0][:, root], rtol=1e-4, atol=1e-4)
    tok = head.to_target(lg0[:, -1:].argmax(-1))
    _, lg1, _ = head.step(tok, out[:, -1:], torch.tensor([root + 1]), cache)
    torch.testing.assert_close(lg1[:, 0], logits[1][:, root], rtol=1e-4, atol=1e-4)
    tap.close()


def test_aux_layer_ids_follow_the_engine_default():
    assert E.aux_layer_ids(36) == [2, 18, 33]      # vLLM / SGLang default for Qwen3-8B
    assert E.aux_layer_ids(8) == [2, 4, 5]
    assert E.aux_layer_ids(6) == [2, 3, 4]          # default [2, 3, 3] collides
    for n in range(5, 40):
        ids = E.aux_layer_ids(n)
        assert ids == sorted(set(ids)) and ids[0] >= 2 and ids[-1] <= n - 1


def test_simulated_acceptance_worked_example_and_self_draft(trained):
    a = torch.tensor([[2, 9, 9, 4, 9, 9, 9, 9, 0]])
    r = simulate(a, chain=4)
    assert r["steps"] == 3 and r["mean_tokens_per_step"] == pytest.approx(3.0)
    assert r["accepted_histogram"] == [1, 0, 1, 0, 1]

    target = Qwen3ForCausalLM.from_pretrained(trained / "tiny-code", dtype=torch.float32).eval()
    prompts = torch.randint(1, 500, (2, 8))
    from train_tiny.lm import greedy_continue
    cont = greedy_continue(target, prompts, 10 + 4, use_cache=False)
    acc = accepted_lengths(cont, 8, 10, draft_proposer(target, 4), 4)
    assert bool((acc == 4).all())  # the target drafting for itself is always accepted
    cached = greedy_continue(target, prompts, 14, use_cache=True)
    assert torch.equal(cached, cont)


def test_dflash_trains_against_an_existing_target_and_serves(trained, tmp_path):
    """--only dflash: a drafter for the target in --base, in z-lab's layout, that the
    draft service loads with that target's embedding and LM head."""
    from treespec.draft_service.dflash_head import DFlashHead
    cmd = [sys.executable, str(ROOT / "bench" / "train_tiny.py"), "--out", str(tmp_path),
           "--device", "cpu", "--tiny", "--max-files", "20", "--steps", "2",
           "--minutes-budget", "0.5", "--gen-seqs", "4", "--eval-prompts", "2",
           "--only", "dflash", "--base", str(trained), "--dflash-layers", "2",
           "--dflash-anchors", "4", "--gen-starts", "0.5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "file starts, teacher-forced" in proc.stdout
    path = tmp_path / "tiny-code-dflash"
    info = json.loads((path / "TRAINING.json").read_text())
    assert all(info[k] >= 1.0 for k in ("held_out_teacher_forced_tokens_per_step",
                                         "held_out_file_starts_tokens_per_step"))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
    assert cfg["num_hidden_layers"] == len(cfg["dflash_config"]["target_layer_ids"]) == 2
    head = DFlashHead.from_pretrained(path, trained / "tiny-code")
    assert head.spec.capture_layers == tuple(i + 1 for i in cfg["dflash_config"]["target_layer_ids"])
    # --dflash-init goes on from that drafter (at learning rate 0 it stays that drafter)
    again = tmp_path / "again"
    proc = subprocess.run(cmd[:3] + [str(again)] + cmd[4:] + [
        "--dflash-init", str(path), "--dflash-lr", "0", "--gen-mix", "1.0"],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    was, now = (load_file(str(d / "tiny-code-dflash" / "model.safetensors"))
                for d in (tmp_path, again))
    assert was.keys() == now.keys() and all(torch.equal(was[k], now[k]) for k in was)


def test_file_starts_are_near_each_documents_first_token():
    stream = torch.tensor([5, 6, 7, 0, 8, 9, 0, 4, 4, 4, 0])        # three documents, eos 0
    assert C.file_starts(stream, 0, length=3, spread=1).tolist() == [0, 1, 4, 5, 7, 8]


def test_a_sigterm_ends_a_stage_after_its_step_so_the_run_still_saves():
    """`timeout` sends SIGTERM: the stage returns what it trained instead of dying."""
    import os
    import signal
    from train_tiny.settings import StageSettings
    from train_tiny import train_loop
    from train_tiny.train_loop import run_stage
    w = torch.nn.Parameter(torch.zeros(2, 2))

    def reached_test(*_):
        raise AssertionError("the SIGTERM reached past the stage")

    before = signal.signal(signal.SIGTERM, reached_test)

    def loss(step: int) -> torch.Tensor:
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return (w - 1).pow(2).sum()

    try:
        res = run_stage("t", [w], loss, StageSettings(50, 1, 1e-2, 1, 1.0), 60.0,
                        torch.device("cpu"), 10)
        assert signal.getsignal(signal.SIGTERM) is reached_test     # put back
        later = run_stage("t2", [w], loss, StageSettings(50, 1, 1e-2, 1, 1.0), 60.0,
                          torch.device("cpu"), 10)
    finally:
        signal.signal(signal.SIGTERM, before)
        train_loop._TERM.clear()
    assert res.steps_run == 4 and res.shrunk_to_budget
    assert later.steps_run == 0                     # a later stage ends at once
    assert float(w.detach().mean()) > 0            # it trained, and kept what it trained
