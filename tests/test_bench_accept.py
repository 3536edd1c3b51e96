"""`treespec bench-accept` as users run it, on the shipped tiny-code pair (its
TRAINING.json names the held-out files): both services as child processes, every row
identical to plain greedy, the table and the JSON rows consistent."""

from __future__ import annotations

import json
import subprocess

from common.launch import child_env, cli_command


def test_bench_accept_rows_are_lossless(tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run(cli_command("bench-accept", "--methods", "ngram,model", "--envelopes",
                                     "chain4", "--files", "2", "--prompt-tokens", "48",
                                     "--max-tokens", "16", "--device", "cpu", "--json", str(out)),
                         capture_output=True, text=True, timeout=300, env=child_env())
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())
    assert [(r["proposer"], r["envelope"]) for r in rows] == [("ngram", "chain4"),
                                                            ("model", "chain4")]
    for r in rows:
        assert r["identical"] and 1.0 <= r["tokens_per_step"] <= 5.0
        assert len(r["accept_by_depth"]) == 4
        assert all(a >= b for a, b in zip(r["accept_by_depth"], r["accept_by_depth"][1:]))
    assert rows[1]["tokens_per_step"] > 1.5          # the trained draft does accept
    assert "| model | chain4 |" in run.stdout
