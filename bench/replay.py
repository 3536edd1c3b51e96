"""Benchmark INSTRUMENTS, not proposers for users: the replay instrument and the
shadow replay.

The replay instrument proposes the target's own greedy continuation (recorded
beforehand through the verify service), corrupted so that the mean tokens per step
is set by the experiment rather than by a draft model's quality: each drafted token
with probability ``--corrupt``, or, with ``--accept K``, exactly the tokens after the
first K of each chain (every step then commits K + 1 tokens, but near a sequence's
end). It has no draft compute. Chains only.

The shadow replay (``--shadow METHOD``) runs a real proposer's whole step (catch-up,
expansion, everything it costs) and then replaces its tree with the replay's chain
(padded to the proposer's envelope): end to end it measures what that drafter costs
at a set tokens per step. Run either as its own draft service:

    python bench/replay.py --continuations FILE (--corrupt 0.15 | --accept 3) --port 0
        [--depth 4 | --shadow model|eagle3 --model DIR [--envelope NAME | --depth D
         --topk K --nodes N]
         [--target-embeddings DIR] [--device D]] [--lookahead K --hit-rate H]

With --lookahead K --hit-rate H it pre-drafts as `treespec draft --lookahead K` does,
but at a set hit rate: the step's true outcome is among a sequence's candidates with
probability H (an instrument's setting; real drafters' hit rates come from
bench/lookahead_cpu.py). With --shadow, the real drafter's own lookahead runs first, for
its cost, where it has one.

With --emulated-draft-ms A[,B] (the EMULATED REMOTE DRAFT, an instrument) each draft
answer and each lookahead takes A + B x rows ms of wall time (a sleep, no compute: a
drafter's measured step on a GPU of its own, which then never time-slices the target's).

FILE is JSON: a list of {"prompt": [ids], "continuation": [ids]}.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch


from treespec.common.spec.tree import PAD, TreeBatch, TreeEnvelope
from treespec.draft_service.lookahead import draft_candidates


class ReplayProposer:
    target_hidden_layers: tuple[int, ...] = ()
    model = "replay-instrument"
    name = "replay-instrument"
    light = True

    def __init__(self, records: list[dict], depth: int, corrupt: float, vocab: int,
                 accept: int | None = None, hit_rate: float | None = None,
                 draft_ms: tuple[float, float] = (0.0, 0.0)) -> None:
        self.refs = {tuple(r["prompt"]): r["continuation"] for r in records}
        self.plen = sorted({len(r["prompt"]) for r in records})
        self.depth, self.corrupt, self.vocab_size = depth, corrupt, vocab
        self.accept = accept
        self.seqs: dict[int, tuple[list[int], tuple[list[int], int] | None]] = {}
        self.rng = random.Random(0)
        # lookahead at a set hit rate (the instrument's, not a drafter's)
        self.hit_rate, self.hit_rng = hit_rate, random.Random(1)
        self.lookahead = hit_rate is not None
        self.draft_ms = draft_ms        # the emulated remote draft's A + B x rows ms

    def _emulate(self, rows: int) -> None:
        ms = self.draft_ms[0] + self.draft_ms[1] * rows
        if ms > 0:
            time.sleep(ms / 1000)

    def update(self, seq_id, tokens, new_count, accepted_nodes, hidden) -> None:
        # the reference is looked up once per sequence (hashing a 1024-token prompt
        # inside every timed step would be the instrument's own cost, not a draft's)
        # (a prompt whose hidden states cross over several steps comes in parts)
        known = self.seqs.get(seq_id)
        found = known[1] if known is not None and known[1] is not None \
            and new_count < len(tokens) else self._continuation(tokens)
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

    def _chain(self, found: tuple[list[int], int] | None, committed: int) -> list[int]:
        """The drafted chain after `committed` tokens: the reference, corrupted."""
        if found is None:
            return []
        ref, plen = found
        done = committed - plen
        return [(t + 1) % self.vocab_size if self._corrupt(i) else t
                for i, t in enumerate(ref[done:done + self.depth])]

    def _batch(self, chains: list[list[int]]) -> TreeBatch:
        n = self.depth
        tokens = [c + [0] * (n - len(c)) for c in chains]
        parents = [list(range(-1, len(c) - 1)) + [PAD] * (n - len(c)) for c in chains]
        shape = (len(chains), n)
        return TreeBatch(torch.tensor(tokens, dtype=torch.int32).view(shape),
                         torch.tensor(parents, dtype=torch.int32).view(shape))

    def propose(self, seq_ids: list[int], sampling=None) -> TreeBatch:
        self._emulate(len(seq_ids))
        chains = []
        for s in seq_ids:
            committed, found = self.seqs.get(s, ((), None))
            chains.append(self._chain(found, len(committed)))
        return self._batch(chains)

    def draft_candidates(self, rows, per_seq: int) -> tuple[torch.Tensor, TreeBatch]:
        """Lookahead at the set hit rate: the step's outcome is known (the tree's
        leading tokens that match the reference, then the reference's next: the
        target's own continuation), so with probability hit_rate candidate 0 is keyed
        by it; every other key is that outcome with a wrong last token (a miss). Each
        candidate's tree is the chain after its key."""
        self._emulate(len(rows))
        keys = torch.full((len(rows) * per_seq, self.depth + 1), -1, dtype=torch.int32)
        chains = []
        for b, r in enumerate(rows):
            found = self.seqs.get(r.seq_id, ((), None))[1]
            if found is None:
                chains += [[]] * per_seq
                continue
            ref, plen = found
            done = len(r.tokens) - plen
            ahead = ref[done:done + self.depth + 1]
            drafted = [t for t, p in zip(r.tree_tokens, r.tree_parents) if p != PAD]
            took = next((i for i, (t, w) in enumerate(zip(drafted, ahead)) if t != w),
                        min(len(drafted), len(ahead)))
            outcome = ahead[:took + 1]
            if not outcome:
                chains += [[]] * per_seq
                continue
            hit = self.hit_rng.random() < self.hit_rate
            for k in range(per_seq):
                key = outcome if hit and k == 0 else \
                    outcome[:-1] + [(outcome[-1] + 1 + k) % self.vocab_size]
                keys[b * per_seq + k, :len(key)] = torch.tensor(key, dtype=torch.int32)
                chains.append(self._chain(found, len(r.tokens) + len(key)))
        return keys, self._batch(chains)


class ShadowReplay:
    """A real proposer's full step, its tree then replaced by the replay's chain."""

    def __init__(self, inner, replay: ReplayProposer, num_nodes: int,
                 raw_hidden: bool = False) -> None:
        self.inner, self.replay, self.num_nodes = inner, replay, num_nodes
        self.lookahead = replay.lookahead
        self.name = f"shadow-replay-instrument:{inner.name}"
        self.model, self.light = inner.model, inner.light
        self.levels = getattr(inner, "levels", False)
        self.vocab_size = inner.vocab_size
        self.target_hidden_layers = inner.target_hidden_layers
        if getattr(inner, "projection", None) is not None and not raw_hidden:
            self.projection = inner.projection      # rows arrive as the inner one takes them

    def update(self, seq_id, tokens, new_count, accepted_nodes, hidden) -> None:
        self.inner.update(seq_id, tokens, new_count, accepted_nodes, hidden)
        self.replay.update(seq_id, tokens, new_count, accepted_nodes, hidden)

    def propose(self, seq_ids: list[int], sampling=None, depth: int = 0) -> TreeBatch:
        # its whole cost (to depth, as it would draft); its tree is not used
        real = self.inner.propose(seq_ids, sampling, **({"depth": depth} if depth else {}))
        chain = self.replay.propose(seq_ids)
        b, d = chain.tokens.shape
        out = TreeBatch.padding(b, self.num_nodes)
        out.tokens[:, :d], out.parents[:, :d] = chain.tokens, chain.parents
        if real.q_ids is not None:    # rejection sampling: the drafter's own q rows, each
            qi, qp = real.q_ids.clone(), real.q_probs.clone()   # led by the replayed token
            qp[:, :d][qi[:, :d] == chain.tokens.unsqueeze(-1)] = 0
            qi[:, :d, 0] = chain.tokens
            out.q_ids, out.q_probs = qi, qp
        return out

    def draft_candidates(self, rows, per_seq: int) -> tuple[torch.Tensor, TreeBatch]:
        """The inner drafter's lookahead, for its cost where it has one; then the
        replay's candidates at its set hit rate, padded to the envelope."""
        if getattr(self.inner, "lookahead", False):
            draft_candidates(self.inner, rows, per_seq, None)
        keys, chains = self.replay.draft_candidates(rows, per_seq)
        out = TreeBatch.padding(chains.tokens.shape[0], self.num_nodes)
        d = chains.tokens.shape[1]
        out.tokens[:, :d], out.parents[:, :d] = chains.tokens, chains.parents
        return keys, out

    def release(self, seq_id) -> None:
        self.inner.release(seq_id)
        self.replay.release(seq_id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--continuations", required=True)
    ap.add_argument("--corrupt", type=float, default=0.15)
    ap.add_argument("--accept", type=int, help="draft exactly this many correct tokens per "
                    "chain, then corrupt the rest (overrides --corrupt)")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--lookahead", type=int, default=0,
                    help="candidates per sequence, as `treespec draft --lookahead`; with "
                         "--hit-rate, the instrument's own (see ReplayProposer.draft_candidates)")
    ap.add_argument("--hit-rate", type=float, default=1.0,
                    help="with --lookahead: the probability that the step's true outcome "
                         "is among a sequence's candidates (an instrument's setting)")
    ap.add_argument("--emulated-draft-ms", default="0",
                    help="A[,B]: each draft answer and lookahead takes A + B x rows ms, "
                         "a sleep (the emulated remote draft; not with --shadow)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--local-socket", default="auto", help="as `treespec draft --local-socket`")
    ap.add_argument("--shadow", choices=["ngram", "model", "eagle3", "dflash"],
                    help="run this proposer's whole step, then replay (the shadow replay)")
    ap.add_argument("--model", help="--shadow's checkpoint")
    ap.add_argument("--envelope", default="chain4", help="--shadow's envelope")
    ap.add_argument("--topk", type=int, help="--shadow's custom envelope, with --depth and "
                    "--nodes (as `treespec draft`'s)")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--target-embeddings", help="--shadow eagle3's or dflash's, as for "
                    "`treespec draft`")
    ap.add_argument("--device", default="auto", help="--shadow's device")
    ap.add_argument("--raw-hidden", action="store_true",
                    help="--shadow's drafter gives the verify no projection: hidden states "
                         "cross as the target's layers (the projection's A/B)")
    ap.add_argument("--num-blocks", type=int, default=4096, help="--shadow's KV pages")
    ap.add_argument("--metrics-port", type=int, help="as `treespec draft --metrics-port`")
    a = ap.parse_args()
    draft_ms = tuple(float(x) for x in f"{a.emulated_draft_ms},0".split(",")[:2])
    if a.shadow and any(draft_ms):
        ap.error("--emulated-draft-ms replaces a drafter's compute: not with --shadow")
    from treespec.common.spec.tree import envelope_from
    from treespec.draft_service import server
    from treespec.draft_service.config import DraftConfig
    from treespec.draft_service.registry import build_proposer
    records = json.loads(Path(a.continuations).read_text())
    if a.shadow:
        env = (envelope_from(a.envelope) if a.topk is None
               else envelope_from(None, a.depth, a.topk, a.nodes))
        cfg = DraftConfig(method=a.shadow, envelope=env, model=a.model,
                          target_embeddings=a.target_embeddings, host=a.host, port=a.port,
                          device=a.device, local_socket=a.local_socket,
                          num_blocks=a.num_blocks, metrics_port=a.metrics_port,
                          lookahead=a.lookahead)
        replay = ReplayProposer(records, cfg.envelope.depth, a.corrupt, a.vocab, a.accept,
                                a.hit_rate if a.lookahead else None)
        proposer = ShadowReplay(build_proposer(cfg), replay, cfg.envelope.num_nodes,
                                a.raw_hidden)
    else:
        env = TreeEnvelope(depth=a.depth, topk=1, num_nodes=a.depth, name=f"chain{a.depth}")
        cfg = DraftConfig(method="ngram", envelope=env, host=a.host, port=a.port,
                          device="cpu", local_socket=a.local_socket,
                          metrics_port=a.metrics_port, lookahead=a.lookahead)
        proposer = ReplayProposer(records, a.depth, a.corrupt, a.vocab, a.accept,
                                  a.hit_rate if a.lookahead else None, draft_ms)
    server.run(cfg, proposer=proposer)


if __name__ == "__main__":
    main()
