"""The `treespec` command line: flags map to config fields, bad combinations exit 2 with
one line, and `generate` prints what the server streamed (against a fake server)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from treespec.common import cli
from treespec.common.serving.launch import child_env
from treespec.common.spec.tree import PRESETS, TreeEnvelope
from treespec.draft_service.config import DraftConfig
from fake_generation import FakeGeneration, FakeServer
from treespec.verify_service.config import VerifyConfig


@pytest.fixture
def served(monkeypatch):
    """Runs `main(argv)` with the server stubbed out; returns (exit code, module, config)."""
    seen = {}
    monkeypatch.setattr(cli, "run_server", lambda module, cfg: seen.update(module=module, cfg=cfg))

    def run(*argv: str):
        code = cli.main(list(argv))
        return code, seen.get("module"), seen.get("cfg")
    return run


def exit_code(*argv: str) -> int:
    """main's exit code, whether argparse exits or main returns."""
    try:
        return cli.main(list(argv))
    except SystemExit as e:
        return int(e.code)


def test_draft_defaults(served):
    code, module, cfg = served("draft", "--method", "ngram", "--port", "0")
    assert (code, module) == (0, "treespec.draft_service.server")
    assert cfg == DraftConfig(method="ngram", envelope=PRESETS["chain4"], port=0)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_draft_envelope_presets(served, name):
    _, _, cfg = served("draft", "--method", "ngram", "--port", "1", "--envelope", name)
    assert cfg.envelope == PRESETS[name]


def test_draft_custom_envelope_and_every_flag(served, draft_dir):
    _, _, cfg = served("draft", "--method", "model", "--model", str(draft_dir), "--depth", "3",
                       "--topk", "2", "--nodes", "6", "--port", "5001", "--host", "0.0.0.0",
                       "--device", "cuda:1", "--dtype", "bfloat16", "--kernels", "reference",
                       "--num-blocks", "64", "--block-size", "8", "--ngram-max", "5",
                       "--ngram-min", "2", "--max-sequences", "9")
    assert cfg == DraftConfig(method="model", envelope=TreeEnvelope(3, 2, 6), model=str(draft_dir),
                              host="0.0.0.0", port=5001, device="cuda:1", dtype="bfloat16",
                              kernels="reference", num_blocks=64, block_size=8, ngram_max=5,
                              ngram_min=2, max_sequences=9)


def test_verify_defaults_and_every_flag(served, target_dir):
    code, module, cfg = served("verify", "--model", str(target_dir), "--port", "0")
    assert (code, module) == (0, "treespec.verify_service.server")
    assert cfg == VerifyConfig(model=str(target_dir), port=0)
    _, _, cfg = served("verify", "--model", str(target_dir), "--draft", "10.0.0.2:5001",
                       "--port", "5000", "--host", "::", "--device", "cuda:0", "--dtype",
                       "float16", "--kernels", "triton", "--max-batch", "8", "--num-blocks",
                       "128", "--block-size", "32", "--step-deadline-ms", "25.5",
                       "--max-model-len", "500", "--prefill-tokens", "512", "--reconnect-s", "2",
                       "--busy-poll", "off", "--draft-socket", "off", "--max-prompt-bytes",
                       "1000", "--max-waiting", "7", "--reflection", "off", "--acceptance",
                       "rejection", "--batch-invariant", "off")
    assert cfg == VerifyConfig(model=str(target_dir), draft="10.0.0.2:5001", host="::", port=5000,
                               device="cuda:0", dtype="float16", kernels="triton", max_batch=8,
                               num_blocks=128, block_size=32, step_deadline_ms=25.5,
                               max_model_len=500, prefill_tokens=512, reconnect_s=2.0,
                               busy_poll="off", draft_socket="off", max_prompt_bytes=1000,
                               max_waiting=7, reflection="off", acceptance="rejection",
                               batch_invariant=False)
    # the target's kernels: bit-exact by default, the fastest only when asked
    assert cfg.target_kernels == "triton"
    assert VerifyConfig(model="m").target_kernels == "invariant"
    assert VerifyConfig(model="m", kernels="reference").target_kernels == "reference"
    assert not cfg.busy("cuda") and VerifyConfig(model="m").busy("cuda")
    assert not VerifyConfig(model="m").busy("cpu") and VerifyConfig(model="m",
                                                                    busy_poll="on").busy("cpu")
    with pytest.raises(ValueError, match="draft_socket must be auto or off"):
        VerifyConfig(model="m", draft_socket="shm")


@pytest.mark.parametrize("argv, message", [
    (["--envelope", "chain4", "--depth", "3"], "not both"),
    (["--depth", "3"], "needs depth, topk and nodes"),
    (["--envelope", "chain9"], "unknown envelope 'chain9'"),
    (["--depth", "4", "--topk", "1", "--nodes", "5"], "chain"),
    (["--depth", "2", "--topk", "2", "--nodes", "99"], "exceeds"),
    (["--method", "model"], "needs --model"),
    (["--method", "model", "--model", "/nonexistent/ckpt"], "no config.json"),
    (["--port", "70000"], "out of range"),
    (["--ngram-min", "3", "--ngram-max", "2"], "ngram_min"),
])
def test_draft_refusals_are_one_line_and_exit_2(served, capsys, argv, message):
    base = ["draft", "--method", "ngram", "--port", "0"]
    code, module, _ = served(*base, *argv)
    err = capsys.readouterr().err
    assert code == 2 and module is None
    assert err.startswith("treespec draft: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--draft", "nocolon"], "HOST:PORT"),
    (["--max-batch", "0"], ">= 1"),
    (["--step-deadline-ms", "0"], "> 0"),
    (["--port", "-1"], "out of range"),
])
def test_verify_refusals_are_one_line_and_exit_2(served, capsys, target_dir, argv, message):
    code, module, _ = served("verify", "--model", str(target_dir), "--port", "0", *argv)
    err = capsys.readouterr().err
    assert code == 2 and module is None and message in err
    assert len(err.strip().splitlines()) == 1


def test_verify_missing_checkpoint_exits_2(served, capsys):
    code, _, _ = served("verify", "--model", "/nonexistent/ckpt", "--port", "0")
    assert code == 2 and "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["draft", "--port", "0"],                                   # --method missing
    ["draft", "--method", "medusa", "--port", "0"],
    ["draft", "--method", "ngram"],                             # --port missing
    ["draft", "--method", "ngram", "--port", "x"],
    ["draft", "--method", "ngram", "--port", "0", "--kernels", "cuda"],
    ["verify", "--port", "0"],                                  # --model missing
    ["verify", "--model", "m", "--port", "0", "--dtype", "int8"],
    ["generate", "--addr", "h:1", "--max-tokens", "3"],         # no prompt
    ["generate", "--addr", "h:1", "--prompt", "a", "--prompt-ids", "1", "--max-tokens", "3"],
    ["generate", "--addr", "h:1", "--prompt-ids", "1,x", "--max-tokens", "3"],
    ["generate", "--addr", "h:1", "--prompt-ids", "1", "--max-tokens", "0"],
    ["generate", "--addr", "h:1", "--prompt-ids", "1"],         # --max-tokens missing
    ["demo", "--method", "medusa"],
    ["bogus"],
    [],
])
def test_argparse_errors_exit_2(argv, capsys):
    assert exit_code(*argv) == 2
    assert "error:" in capsys.readouterr().err


def test_generate_json_prints_one_object(capsys):
    fake = FakeGeneration([[1, 2], [3]])
    with FakeServer(fake) as addr:
        code = cli.main(["generate", "--addr", addr, "--prompt-ids", "4, 5,6", "--max-tokens",
                         "3", "--json", "--stop-ids", "7,8", "9", "--ignore-eos",
                         "--no-speculation"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("\n") == 1
    obj = json.loads(out)
    assert obj == {"token_ids": [1, 2, 3], "text": "", "finish_reason": "length",
                   "stats": {"steps": 2, "draft_tokens": 0, "accepted_tokens": 0,
                             "fallback_steps": 0, "planned_plain_steps": 0, "prompt_tokens": 3,
                             "completion_tokens": 3, "cached_tokens": 0}}
    r = fake.requests[-1]
    assert list(r.prompt_ids) == [4, 5, 6] and r.max_tokens == 3
    assert list(r.stop_token_ids) == [7, 8, 9] and r.ignore_eos and r.no_speculation
    assert not r.sampling.HasField("temperature")      # unset: the server's default


def test_generate_streams_ids_without_a_tokenizer(capsys):
    with FakeServer(FakeGeneration([[1, 2], [3]])) as addr:
        assert cli.main(["generate", "--addr", addr, "--prompt-ids", "4", "--max-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.split() == ["1", "2", "3"]
    assert "[length] 3 tokens in 2 steps" in err


def test_generate_streams_text_with_a_tokenizer(capsys):
    fake = FakeGeneration([[1, 2], [3]], tokenizer=True)
    with FakeServer(fake) as addr:
        assert cli.main(["generate", "--addr", addr, "--prompt", "hi", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out == "<1><2><3>\n"
    assert fake.requests[-1].prompt == "hi" and not fake.requests[-1].prompt_ids


def test_generate_server_error_exits_1_with_the_status(capsys):
    with FakeServer(FakeGeneration([[1]])) as addr:
        code = cli.main(["generate", "--addr", addr, "--prompt-ids", "1", "--max-tokens", "2",
                         "--temperature", "-0.9", "--json"])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert captured.err == ("treespec generate: error: INVALID_ARGUMENT: "
                            "temperature must be >= 0\n")


def test_importing_the_cli_loads_no_service_and_no_torch():
    code = ("import sys, treespec.common.cli; bad = sorted(m for m in sys.modules if "
            "m.split('.')[0] in ('torch', 'transformers') or m.startswith(("
            "'treespec.draft_service', 'treespec.verify_service'))); print(bad); "
            "sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          env=child_env(), timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_python_dash_m_runs_the_cli():
    proc = subprocess.run([sys.executable, "-P", "-m", "treespec.common.cli", "draft", "--help"],
                          capture_output=True, text=True, env=child_env(), timeout=60)
    assert proc.returncode == 0 and "--envelope" in proc.stdout
