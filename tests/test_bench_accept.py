"""bench/accept.py end to end on the shipped tiny-code pair (its TRAINING.json names
the held-out files): every row is identical to plain greedy."""

from __future__ import annotations

from bench import accept as bench_accept


def test_bench_accept_rows_are_lossless():
    rows = bench_accept.run("tiny-code", ["chain4", "tree-small"], ["ngram", "model"], files=2,
                            prompt_tokens=48, max_tokens=16, device="cpu")
    assert len(rows) == 4 and all(r["identical"] for r in rows)
    for r in rows:
        assert 1.0 <= r["tokens_per_step"] <= 5.0
        assert len(r["accept_by_depth"]) == 4
        assert all(a >= b for a, b in zip(r["accept_by_depth"], r["accept_by_depth"][1:]))
    assert bench_accept.format_row(rows[0]).startswith("| ngram | chain4 |")
