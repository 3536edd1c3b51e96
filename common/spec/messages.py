"""Domain types of the Speculate hop, free of protobuf (see protos/treespec/v1).

The verify service is the only authority on committed tokens; these messages
tell the draft what was committed since it last heard, and carry its trees back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treespec.common.spec.sampling import SamplingParams
from treespec.common.spec.tree import TreeBatch, TreeEnvelope


@dataclass
class SeqUpdate:
    seq_id: int
    committed_len: int            # after new_tokens, prompt included
    new_tokens: list[int]         # since the last update; everything if full
    full: bool = False
    accepted_nodes: list[int] = field(default_factory=list)  # of step accepted_step_id
    accepted_step_id: int = 0
    hidden: torch.Tensor | None = None  # [len(new_tokens), layers * hidden]
    sampling: SamplingParams | None = None  # full updates of a sampling request only
    rejection: bool = False       # with sampling: accepted by rejection sampling (else coupled)
    lookahead_hit: int = 0        # k + 1: this step verifies lookahead candidate k (no tree)
    lookahead: bool = False       # pre-draft candidates for the next step
    # full updates to a feature drafter: the first cached_len tokens' state comes from
    # the draft's prefix cache (the verify reused their KV: it has no hidden states of
    # them); hidden then holds the rows of new_tokens[cached_len + 1:]
    cached_len: int = 0


@dataclass
class SpecRequest:
    step_id: int
    seqs: list[SeqUpdate]
    released: list[int] = field(default_factory=list)
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C carrier; {} = untraced
    max_depth: int = 0          # nodes deeper are not verified (0: the whole envelope)


@dataclass
class SpecResponse:
    """The draft's answer to one SpecRequest: a tree per sequence, in the request's
    order (padding rows for the sequences it asks to resync)."""

    step_id: int
    seq_ids: list[int]
    trees: TreeBatch
    resync: list[int] = field(default_factory=list)
    # full updates whose cached prefix (cached_len) the draft does not hold: dropped,
    # padding rows, never to be drafted for (their hidden states exist nowhere)
    lost_prefix: list[int] = field(default_factory=list)


@dataclass
class Lookahead:
    """What the draft pre-drafted, after answering step_id, for the step after it: per
    sequence in seq_ids, K candidate trees (``trees`` row b * K + k; all padding: none),
    each for the outcome whose committed tokens are its key (``keys`` [B * K, depth + 1],
    padded with -1)."""

    step_id: int
    seq_ids: list[int]
    trees: TreeBatch
    keys: torch.Tensor

    def candidates(self, per_seq: int) -> dict[int, list[tuple[tuple[int, ...], int]]]:
        """seq_id -> [(key, row of trees)] of its non-empty candidates."""
        valid = self.trees.num_valid()
        keys = self.keys.tolist()
        out: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for b, s in enumerate(self.seq_ids):
            rows = range(b * per_seq, (b + 1) * per_seq)
            out[s] = [(tuple(t for t in keys[r] if t >= 0), r) for r in rows if valid[r]]
        return out


@dataclass(frozen=True)
class DrafterInfo:
    envelope: TreeEnvelope
    vocab_size: int
    proposer: str
    target_hidden_layers: tuple[int, ...] = ()
    model: str = ""
    max_model_len: int = 0          # committed tokens a sequence may have (0: no limit)
    projected_width: int = 0        # hidden states it also takes projected (see the proto)
    lookahead: int = 0              # candidate trees pre-drafted per sequence (0: none)
    prefix_block_size: int = 0      # it caches its state of prefixes in such pages (0: none)
