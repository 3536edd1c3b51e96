"""Where each process's sampled host time goes, from py-spy's collapsed stacks
(`bash bench/device_session.sh run` with STEPS=pyspy writes them as pyspy.txt.gz):

    python bench/pyspy_top.py pyspy.txt.gz [--top 25] [--only verify_service]

Per process (one per service a bench row started): its samples, and the project's
functions (frames under common/, verify_service/, draft_service/, kernels/) by the share
of samples they are on the stack of (inclusive) and on top of (self, the innermost
project frame)."""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter, defaultdict

OURS = re.compile(r"^(.*?) \(((?:common|verify_service|draft_service|kernels)/[^:]+):\d+\)$")


def parse(path: str) -> dict[str, tuple[int, Counter, Counter]]:
    """process (pid and command) -> (samples, inclusive counts, self counts) by
    'function (file)'; py-spy nests a child's stacks under its parents' process frames."""
    total: Counter = Counter()
    incl: dict[str, Counter] = defaultdict(Counter)
    own: dict[str, Counter] = defaultdict(Counter)
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            frames = stack.split(";")
            at = max(i for i, fr in enumerate(frames) if fr.startswith("process "))
            pid, n = frames[at][:160], int(n)      # the innermost process: its command
            total[pid] += n
            ours = [f"{m.group(1)} ({m.group(2)})" for fr in frames[at + 1:]
                    if (m := OURS.match(fr.strip()))]
            for name in set(ours):
                incl[pid][name] += n
            if ours:
                own[pid][ours[-1]] += n
    return {p: (total[p], incl[p], own[p]) for p in total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--only", default="", help="processes with a frame under this dir")
    a = ap.parse_args()
    for pid, (n, incl, own) in sorted(parse(a.path).items(), key=lambda kv: -kv[1][0]):
        if a.only and not any(a.only + "/" in k for k in incl):
            continue
        print(f"{pid}: {n} samples")
        for name, c in incl.most_common(a.top):
            print(f"  {100 * c / n:5.1f} % incl  {100 * own[name] / n:5.1f} % self  {name}")


if __name__ == "__main__":
    main()
