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
    # two pairs at once; each draft is up before its verify starts, so the second
    # verify's one line can only be about its token
    guarded = services.draft_argv("ngram", "--local-socket", "off", "--api-key-file", str(keys))
    with services.at_once(guarded, guarded) as (draft, draft2), services.at_once(
            services.verify_argv(target_dir, "--api-key-file", str(keys),
                                 "--draft-api-key-file", str(good), draft=draft.addr),
            services.verify_argv(target_dir, "--reconnect-s", "0.3", "--draft-api-key-file",
                                 str(wrong), draft=draft2.addr)) as (v, v2):
        up = time.monotonic()
        services.wait_draft_connected(v, api_key="second-token")
        health, *refused, ok, plain = services.run_clis(
            ["health", "--addr", v.addr],
            services.generate_args(v.addr, PROMPT, 4),
            services.generate_args(v.addr, PROMPT, 4, "--api-key-file", str(wrong)),
            services.generate_args(v.addr, PROMPT, 16, "--ignore-eos", "--json",
                                   "--api-key-file", str(good)),
            services.generate_args(v2.addr, PROMPT, 8, "--ignore-eos", "--json"))
        time.sleep(max(0.0, up + 2.0 - time.monotonic()))    # several reconnect attempts
        lines = [x for x in v2.output().splitlines() if "unavailable" in x]
    assert health.returncode == 0 and health.stdout.strip() == "SERVING"
    for proc in refused:
        assert proc.returncode == 1 and "UNAUTHENTICATED" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    out = services.parse_json(ok)
    assert out["stats"]["draft_tokens"] > 0, out["stats"]
    out = services.parse_json(plain)
    assert out["stats"]["draft_tokens"] == 0 and len(out["token_ids"]) == 8
    assert len(lines) == 1 and "UNAUTHENTICATED" in lines[0], lines
