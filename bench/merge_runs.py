"""Merge bench/drafters.py runs made back to back on one machine into one table and plot.

    python bench/merge_runs.py a.json b.json --out merged.json [--png merged.png]

Each row keeps its own run's over_plain (against the plain passes of the call it ran in);
the merged plain is the mean of every run's plain passes, for the plot's plain line.
Prints a markdown table: one pass × plain / paired median / worst paired turn."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from drafters import plot


def merge(runs: list[dict]) -> dict:
    passes = [r[k] for r in runs for k in ("plain", "plain_again") if k in r]
    batches = sorted({b for p in passes for b in p}, key=int)
    plain = {b: {"tok_s": sum(p[b]["tok_s"] for p in passes if b in p)
                 / sum(b in p for p in passes)} for b in batches}
    rows = {key: cells for r in runs for key, cells in r["rows"].items()}
    return {**runs[0], "plain": plain, "plain_passes": passes, "rows": rows,
            "plain_again": None, "errors": {k: v for r in runs for k, v in r["errors"].items()}}


def cell(c: dict) -> str:
    text = f"{c['over_plain']:.3f}"
    if "paired_turns" in c:
        text += f" / {c['over_plain_paired']:.3f} / {min(c['paired_turns']):.3f}"
    return text if c.get("lossless", True) else text + " (NOT LOSSLESS)"


def table(res: dict) -> str:
    bs = list(res["plain"])
    lines = ["| row | " + " | ".join(f"b{b}" for b in bs) + " |",
             "| --- |" + " --- |" * len(bs),
             "| plain tok/s (mean of passes) | "
             + " | ".join(f"{res['plain'][b]['tok_s']:.0f}" for b in bs) + " |"]
    for key, cells in res["rows"].items():
        lines.append(f"| {key} | " + " | ".join(cell(cells[b]) if b in cells else "–"
                                                 for b in bs) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--png")
    a = ap.parse_args()
    res = merge([json.loads(Path(p).read_text()) for p in a.runs])
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(table(res))
    if a.png:
        plot(res, Path(a.png))


if __name__ == "__main__":
    main()
