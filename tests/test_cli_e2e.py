"""`treespec draft`, `treespec verify` and `treespec generate` as real processes: the
speculative greedy output equals transformers' greedy output token for token."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import Qwen3ForCausalLM

import services
from treespec.common.client import TreespecClient

pytestmark = pytest.mark.skipif(services.servers_missing() is not None,
                                reason=f"{services.servers_missing()}: the services are being "
                                       "written; this test runs once both server modules exist")

# Repeated spans, so the n-gram proposer finds candidates from the first step.
PROMPT = [5, 17, 23, 42, 8, 17, 23, 42, 8, 17, 23]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(target_dir) -> list[int]:
    """transformers greedy continuation of PROMPT, ignoring EOS."""
    hf = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([PROMPT])
    # an explicit mask: generate would otherwise read pad_token_id in the prompt as padding
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=MAX_TOKENS, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def ngram_stack(target_dir):
    with services.stack(target_dir, "ngram") as pair:
        yield pair


@pytest.fixture(scope="module")
def model_stack(target_dir, draft_dir):
    with services.stack(target_dir, "model", draft_model=draft_dir,
                        draft_args=("--envelope", "tree-small")) as pair:
        yield pair


def check_stats(out: dict, speculative: bool) -> None:
    s = out["stats"]
    assert out["finish_reason"] == "length"
    assert s["prompt_tokens"] == len(PROMPT) and s["completion_tokens"] == MAX_TOKENS
    assert 1 <= s["steps"] <= MAX_TOKENS - 1   # prefill makes the first token
    assert 0 <= s["accepted_tokens"] <= s["draft_tokens"]
    assert 0 <= s["fallback_steps"] <= s["steps"]
    if speculative:
        assert s["draft_tokens"] > 0, s
    else:
        assert s["draft_tokens"] == s["accepted_tokens"] == 0, s
        assert s["steps"] == MAX_TOKENS - 1, s


@pytest.mark.parametrize("stack", ["ngram_stack", "model_stack"])
def test_speculative_greedy_equals_transformers(stack, reference, request):
    _, verify = request.getfixturevalue(stack)
    out = services.generate_json(verify.addr, PROMPT, MAX_TOKENS, "--ignore-eos")
    assert out["token_ids"] == reference
    check_stats(out, speculative=True)


def test_plain_decode_equals_transformers(ngram_stack, reference):
    _, verify = ngram_stack
    out = services.generate_json(verify.addr, PROMPT, MAX_TOKENS, "--ignore-eos",
                                 "--no-speculation")
    assert out["token_ids"] == reference
    check_stats(out, speculative=False)


def test_streamed_output_prints_the_same_token_ids(ngram_stack, reference):
    """The test checkpoints have no tokenizer, so the stream shows token ids."""
    _, verify = ngram_stack
    proc = services.run_cli(*services.generate_args(verify.addr, PROMPT, MAX_TOKENS,
                                                    "--ignore-eos"))
    assert proc.returncode == 0, proc.stderr
    assert [int(t) for t in proc.stdout.split()] == reference
    assert "[length]" in proc.stderr


def test_stop_token_ends_the_completion(ngram_stack, reference):
    _, verify = ngram_stack
    stop = reference[5]
    out = services.generate_json(verify.addr, PROMPT, MAX_TOKENS, "--ignore-eos",
                                 "--stop-ids", str(stop))
    first = reference.index(stop)
    assert out["finish_reason"] == "stop"
    # whether the stop id itself is returned is the server's choice; nothing after it is
    assert out["token_ids"] in (reference[:first + 1], reference[:first])


def test_bad_sampling_parameters_are_invalid_argument(ngram_stack):
    _, verify = ngram_stack
    proc = services.run_cli(*services.generate_args(verify.addr, PROMPT, 4, "--temperature",
                                                    "-0.8"))
    assert proc.returncode == 1
    assert "INVALID_ARGUMENT" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "temperature" in proc.stderr


def test_a_seeded_sample_repeats_and_speculation_keeps_it(ngram_stack):
    """Coupled acceptance: the same seed gives the same tokens, with speculation or
    without; another seed other tokens."""
    _, verify = ngram_stack
    runs = [services.generate_json(verify.addr, PROMPT, 12, "--ignore-eos", "--temperature",
                                   "1.0", "--seed", seed, *extra)["token_ids"]
            for seed, extra in (("7", ()), ("7", ()), ("7", ("--no-speculation",)),
                                ("8", ()))]
    assert runs[0] == runs[1] == runs[2] != runs[3]


def test_draft_service_stops_cleanly_on_sigterm():
    draft = services.start_draft("ngram")
    with TreespecClient(draft.addr) as c:  # health only: any treespec service has it
        c.wait_ready(30.0)
    start = time.monotonic()
    assert draft.stop(grace=20.0) == 0, draft.output(40)
    assert time.monotonic() - start < 20.0


@pytest.mark.parametrize("busy_poll", ["off", "on"])
def test_the_local_carrier_works_in_the_cli_services(target_dir, reference, busy_poll):
    """The services run on uvloop, which refuses abstract socket addresses given as
    strings: until treespec.common.wire.frames made the sockets itself, `--local-socket auto` fell
    back to gRPC unnoticed."""
    carrier = "unix socket"
    with services.stack(target_dir, "ngram",                     # --local-socket auto: default
                        verify_args=("--busy-poll", busy_poll)) as (_, verify):
        out = services.generate_json(verify.addr, PROMPT, MAX_TOKENS, "--ignore-eos")
        log = verify.output()
    assert out["token_ids"] == reference
    check_stats(out, speculative=True)
    assert f"steps by {carrier}" in log, log
    assert "not usable here" not in log, log
