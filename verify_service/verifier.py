"""The verify step: one target forward over [root, tree nodes] for every running
sequence, greedy acceptance, and the KV commit of each accepted path.

No state lives here: it takes sequences and a proposal and returns what was
accepted; the engine owns the bookkeeping. See common/accept.py for the terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from common.accept import commit_plan
from common.forward_batch import Chunk, build_forward_batch, chain_chunk
from common.kv_cache import PagedKVCache, SeqPages
from common.qwen3 import Qwen3Model
from common.tree import verify_chunk_layout


@dataclass
class StepResult:
    accepted: list[list[int]]   # per sequence: accepted node indices, root to leaf
    bonus: list[int]            # per sequence: the target's token after the path
    # per sequence, when capturing: target hidden states [1 + len(path), C] of the
    # root and the accepted nodes (device tensors), C = layers * hidden
    hidden: list[torch.Tensor] | None = None


def concat_captured(captured: list[torch.Tensor]) -> torch.Tensor | None:
    """The captured layers side by side: [T, layers * hidden], or None."""
    return torch.cat(captured, dim=-1) if captured else None


class Verifier:
    reserved_pages = 0   # pages the verifier itself holds

    def __init__(self, model: Qwen3Model, cache: PagedKVCache, ops: ModuleType) -> None:
        self.model, self.cache, self.ops = model, cache, ops
        self.capture_layers: tuple[int, ...] = ()   # target layers a drafter asked for

    @torch.inference_mode()
    def prefill(self, pages: list[SeqPages], prompts: list[list[int]]
                ) -> tuple[list[int], list[torch.Tensor] | None]:
        """Write every prompt's KV; returns each prompt's greedy next token and, when
        capturing, each prompt's hidden states [len(prompt), C]."""
        fb = build_forward_batch([chain_chunk(p, t) for p, t in zip(pages, prompts)], self.cache)
        hidden, captured = self.model(fb, self.cache, self.ops, self.capture_layers)
        nxt = self.model.greedy(hidden[fb.last], self.ops).tolist()
        for p, t in zip(pages, prompts):
            p.kv_len += len(t)
        feats = concat_captured(captured)
        if feats is None:
            return nxt, None
        cu = fb.cu_q.tolist()
        return nxt, [feats[cu[i]:cu[i + 1]] for i in range(len(prompts))]

    @torch.inference_mode()
    def step(self, pages: list[SeqPages], roots: list[int], tokens: torch.Tensor | None,
             parents: torch.Tensor | None, depth: int) -> StepResult:
        """Verify one tree per sequence (tokens, parents [B, N]); None = plain decode."""
        b = len(pages)
        dev = self.cache.device
        if tokens is None:
            tokens = torch.zeros((b, 0), dtype=torch.int32)
            parents = torch.zeros((b, 0), dtype=torch.int32)
        chunk_parents, depths = verify_chunk_layout(parents)
        cp, dp, tk = chunk_parents.tolist(), depths.tolist(), tokens.tolist()
        chunks = [Chunk(pages[i], [roots[i]] + tk[i], cp[i], dp[i]) for i in range(b)]
        fb = build_forward_batch(chunks, self.cache)
        hidden, captured = self.model(fb, self.cache, self.ops, self.capture_layers)
        n1 = tokens.shape[1] + 1
        target_ids = self.model.greedy(hidden, self.ops).view(b, n1)             # [B, N+1]
        accepted, num, bonus = self.ops.accept_greedy(
            tokens.to(dev), parents.to(dev), target_ids, max(depth, 1) if n1 > 1 else 0)
        kv_lens = fb.context_lens
        seq, src, dst = commit_plan(accepted, num, kv_lens)
        if src.numel():
            table = fb.block_tables.long()
            bs = self.cache.block_size
            flat_src = table[seq, src // bs] * bs + src % bs
            flat_dst = table[seq, dst // bs] * bs + dst % bs
            self.ops.compact_kv(self.cache.k, self.cache.v, flat_src, flat_dst)
        acc_l, num_l, bonus_l = accepted.tolist(), num.tolist(), bonus.tolist()
        paths = [acc_l[i][:num_l[i]] for i in range(b)]
        for i in range(b):
            pages[i].kv_len += 1 + num_l[i]
        feats = concat_captured(captured)
        rows = None
        if feats is not None:
            rows = [feats[i * n1 + torch.tensor([0] + [1 + j for j in paths[i]], device=dev)]
                    for i in range(b)]
        return StepResult(paths, bonus_l, rows)
