"""Bearer tokens on both hops, services started through the CLI: a call without a
token (or with a wrong one) gets UNAUTHENTICATED, health checks stay open, a verify
service with the draft's token gets its trees, and one with a wrong token serves plain
decode and says why once."""

from __future__ import annotations

import time

import services

PROMPT = [5, 17, 23, 42, 8, 17, 23, 42, 8, 17, 23]


def test_tokens_guard_both_hops(target_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# operators' tokens\nfirst-token\n\nsecond-token\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-a-token\n")
    good = tmp_path / "good"
    good.write_text("second-token\n")
    draft = services.start_draft("ngram", "--local-socket", "off", "--api-key-file", str(keys))
    with draft, services.start_verify(target_dir, "--api-key-file", str(keys),
                                      "--draft-api-key-file", str(good), draft=draft.addr) as v:
        health = services.run_cli("health", "--addr", v.addr)
        assert health.returncode == 0 and health.stdout.strip() == "SERVING"
        for flags in ((), ("--api-key-file", str(wrong))):
            proc = services.run_cli(*services.generate_args(v.addr, PROMPT, 4, *flags))
            assert proc.returncode == 1 and "UNAUTHENTICATED" in proc.stderr, proc.stderr
            assert "Traceback" not in proc.stderr
        out = services.generate_json(v.addr, PROMPT, 16, "--ignore-eos",
                                     "--api-key-file", str(good))
        assert out["stats"]["draft_tokens"] > 0, out["stats"]
    with services.start_draft("ngram", "--local-socket", "off", "--api-key-file",
                              str(keys)) as draft, \
            services.start_verify(target_dir, "--reconnect-s", "0.3", "--draft-api-key-file",
                                  str(wrong), draft=draft.addr) as v:
        out = services.generate_json(v.addr, PROMPT, 8, "--ignore-eos")
        time.sleep(1.5)
        lines = [x for x in v.output().splitlines() if "unavailable" in x]
    assert out["stats"]["draft_tokens"] == 0 and len(out["token_ids"]) == 8
    assert len(lines) == 1 and "UNAUTHENTICATED" in lines[0], lines
