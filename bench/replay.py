"""A benchmark INSTRUMENT, not a proposer for users: it proposes the target's own
greedy continuation (recorded beforehand through the verify service with
speculation off), corrupted so that the mean tokens per step is set by the
experiment rather than by a draft model's quality: each drafted token with
probability ``--corrupt``, or, with ``--accept K``, exactly the tokens after the
first K of each chain (every step then commits K + 1 tokens, but near a
sequence's end). Chains only. Run as its own draft service:

    python bench/replay.py --continuations FILE (--corrupt 0.15 | --accept 3) --port 0 [--depth 4]

FILE is JSON: a list of {"prompt": [ids], "continuation": [ids]}.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.tree import PAD, TreeBatch, TreeEnvelope  # noqa: E402


class ReplayProposer:
    needs_model = False
    target_hidden_layers: tuple[int, ...] = ()
    model = "replay-instrument"
    name = "replay-instrument"
    light = True

    def __init__(self, records: list[dict], depth: int, corrupt: float, vocab: int,
                 accept: int | None = None) -> None:
        self.refs = {tuple(r["prompt"]): r["continuation"] for r in records}
        self.plen = sorted({len(r["prompt"]) for r in records})
        self.depth, self.corrupt, self.vocab_size = depth, corrupt, vocab
        self.accept = accept
        self.seqs: dict[int, tuple[list[int], tuple[list[int], int] | None]] = {}
        self.rng = random.Random(0)

    def update(self, seq_id, tokens, new_count, accepted_nodes, hidden) -> None:
        # the reference is looked up once per sequence (hashing a 1024-token prompt
        # inside every timed step would be the instrument's own cost, not a draft's)
        known = self.seqs.get(seq_id)
        found = known[1] if known is not None and new_count < len(tokens) \
            else self._continuation(tokens)
        self.seqs[seq_id] = (tokens, found)

    def release(self, seq_id) -> None:
        self.seqs.pop(seq_id, None)

    def _continuation(self, tokens: list[int]) -> tuple[list[int], int] | None:
        """(the continuation, its prompt's length) of the record tokens start with."""
        for n in self.plen:
            ref = self.refs.get(tuple(tokens[:n]))
            if ref is not None:
                return ref, n
        return None

    def _corrupt(self, i: int) -> bool:
        if self.accept is not None:
            return i >= self.accept
        return self.rng.random() < self.corrupt

    def propose(self, seq_ids: list[int]) -> TreeBatch:
        n = self.depth
        tokens, parents = [], []
        for s in seq_ids:
            committed, found = self.seqs.get(s, ((), None))
            draft: list[int] = []
            if found is not None:
                ref, plen = found
                done = len(committed) - plen
                draft = [(t + 1) % self.vocab_size if self._corrupt(i) else t
                         for i, t in enumerate(ref[done:done + n])]
            k = len(draft)
            tokens.append(draft + [0] * (n - k))
            parents.append(list(range(-1, k - 1)) + [PAD] * (n - k))
        shape = (len(seq_ids), n)
        return TreeBatch(torch.tensor(tokens, dtype=torch.int32).view(shape),
                         torch.tensor(parents, dtype=torch.int32).view(shape))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--continuations", required=True)
    ap.add_argument("--corrupt", type=float, default=0.15)
    ap.add_argument("--accept", type=int, help="draft exactly this many correct tokens per "
                    "chain, then corrupt the rest (overrides --corrupt)")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--local-socket", default="auto", help="as `treespec draft --local-socket`")
    a = ap.parse_args()
    from draft_service import server
    from draft_service.config import DraftConfig
    env = TreeEnvelope(depth=a.depth, topk=1, num_nodes=a.depth, name=f"chain{a.depth}")
    cfg = DraftConfig(method="ngram", envelope=env, host=a.host, port=a.port, device="cpu",
                      local_socket=a.local_socket)
    records = json.loads(Path(a.continuations).read_text())
    server.run(cfg, proposer=ReplayProposer(records, a.depth, a.corrupt, a.vocab, a.accept))


if __name__ == "__main__":
    main()
