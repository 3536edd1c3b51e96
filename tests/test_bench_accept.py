"""bench/accept.py end to end on the demo's random pair (which ships a tokenizer),
with a held-out list in TRAINING.json: every row is identical to plain greedy."""

from __future__ import annotations

import json
import shutil

from bench import accept as bench_accept
from common.demo_checkpoints import random_pair


def test_bench_accept_rows_are_lossless(tmp_path, monkeypatch):
    pair = random_pair(tmp_path / "cache")
    target = tmp_path / "target"
    shutil.copytree(pair.target, target)
    (target / "TRAINING.json").write_text(json.dumps(
        {"held_out_files": ["textwrap.py", "heapq.py"]}))
    monkeypatch.setitem(bench_accept.PROPOSERS, "model", str(pair.draft))
    rows = bench_accept.run(str(target), ["chain4", "tree-small"], ["ngram", "model"], files=2,
                            prompt_tokens=48, max_tokens=16, device="cpu")
    assert len(rows) == 4 and all(r["identical"] for r in rows)
    for r in rows:
        assert 1.0 <= r["tokens_per_step"] <= 5.0
        assert len(r["accept_by_depth"]) == 4
        assert all(a >= b for a, b in zip(r["accept_by_depth"], r["accept_by_depth"][1:]))
    assert bench_accept.format_row(rows[0]).startswith("| ngram | chain4 |")
