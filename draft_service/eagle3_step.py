"""The EAGLE-3 head's draft step on the device, and at fixed shapes for CUDA graphs.

``expand_eagle3`` is everything after the catch-up: depth - 1 tree chunks whose
hidden inputs are their parents' outputs, and the rerank (see eagle3_proposer
for the alignment). It takes only device tensors and reads nothing back, so
``eagle3_step``, which puts a fixed-shape catch-up in front of it, is one CUDA
graph per (batch bucket, page bucket): in steady state a sequence brings at most
depth + 1 new committed pairs (the accepted path and the bonus), so the catch-up
is a [B, depth + 1] chain whose unused tail is padding.
"""

from __future__ import annotations

from types import ModuleType

import torch

from common.forward_batch import device_forward_batch, padded_chain_batch
from common.graph_buckets import BucketedGraphs
from common.kv_cache import PagedKVCache, SeqPages
from common.tree import TreeEnvelope
from draft_service.eagle3_head import Eagle3Head
from draft_service.graph_expansion import level_depths
from draft_service.tree_build import Expansion


def expand_eagle3(head: Eagle3Head, cache: PagedKVCache, ops: ModuleType, env: TreeEnvelope,
                  depths: list[torch.Tensor], root: torch.Tensor, ctx: torch.Tensor,
                  table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """root [B, H]: the catch-up's output at each newest pair; ctx [B] int32
    committed pairs (the tree is scratch after them); table [B, P] -> tokens,
    parents [B, N] (target ids)."""
    exp = Expansion(head.logits(root, ops).log_softmax(-1), env.topk, env.depth)
    b, k, hid = root.shape[0], env.topk, root.shape[-1]
    prev = root.new_zeros(b, 0, hid)               # [B, (level-1)*K, H] last chunk's outputs
    for level in range(1, env.depth):
        tok, par, _ = exp.chunk(level)                                  # [B, level*K]
        src = torch.cat([root.unsqueeze(1), prev], 1)                   # parent -1 = root
        hin = src.gather(1, (par + 1).unsqueeze(-1).expand(-1, -1, hid))
        fb = device_forward_batch(head.to_target(tok), par, depths[level - 1], ctx, table,
                                  cache.block_size)
        prev = head(fb, cache, ops, hin.view(b * level * k, hid)).view(b, level * k, hid)
        newest = prev[:, (level - 1) * k:]                              # [B, K, H]
        logp = head.logits(newest.reshape(b * k, -1), ops).log_softmax(-1)
        exp.grow(level, logp.view(b, k, -1))
    t, p, _ = exp.rerank(env.num_nodes)
    return head.to_target(t), p


def eagle3_step(head: Eagle3Head, cache: PagedKVCache, ops: ModuleType, env: TreeEnvelope,
                depths: list[torch.Tensor], tokens: torch.Tensor, feats: torch.Tensor,
                count: torch.Tensor, ctx0: torch.Tensor, table: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, C] int64 and feats [B, C, F]: row b's first count[b] (>= 1) new
    pairs (token, target features), written from pair position ctx0[b] on; the
    tail is padding (it sees only itself and writes slots the expansion
    overwrites or never reads). table covers ctx0 + C + the tree's scratch."""
    b, c = tokens.shape
    fb = padded_chain_batch(tokens, count, ctx0, table, cache.block_size)
    out = head(fb, cache, ops, head.features(feats.reshape(b * c, -1)))          # [B*C, H]
    root = out.view(b, c, -1)[torch.arange(b, device=tokens.device), count.long() - 1]
    return expand_eagle3(head, cache, ops, env, depths, root, ctx0 + count, table)


class Eagle3Graphs:
    """``eagle3_step`` per (batch bucket, page bucket), replayed as a CUDA graph on a
    GPU (eagerly on the CPU, over the same buffers)."""

    def __init__(self, head: Eagle3Head, cache: PagedKVCache, ops: ModuleType,
                 env: TreeEnvelope, capture: bool = True) -> None:
        self.head, self.cache, self.ops, self.env = head, cache, ops, env
        self.buckets = BucketedGraphs(cache, capture)
        self.depths = level_depths(env, cache.device)
        self.catch_up_len = env.depth + 1

    @torch.inference_mode()
    def __call__(self, new_tokens: list[list[int]], new_feats: list[torch.Tensor],
                 pages: list[SeqPages]) -> tuple[torch.Tensor, torch.Tensor]:
        """new_tokens[r] (1 .. catch_up_len) and new_feats[r] [same, F] on the
        device: row r's new pairs from pages[r].kv_len on. Advancing kv_len is the
        caller's."""
        gb, dev, c = self.buckets, self.cache.device, self.catch_up_len
        f = self.head.spec.feature_size
        real = len(pages)
        b, p, table = gb.shape(pages)
        tokens, count, ctx0 = gb.chain_inputs(new_tokens, pages, b, c)
        feats = torch.zeros((b, c, f), dtype=self.head.dtype, device=dev)
        for r, rows in enumerate(new_feats):
            feats[r, :rows.shape[0]] = rows
        head, cache, ops, env, depths = self.head, self.cache, self.ops, self.env, self.depths

        def example(bb: int) -> list[torch.Tensor]:
            return [torch.zeros((bb, c), dtype=torch.int64, device=dev),
                    torch.zeros((bb, c, f), dtype=head.dtype, device=dev),
                    torch.ones(bb, dtype=torch.int32, device=dev),
                    torch.zeros(bb, dtype=torch.int32, device=dev), gb.table_example(bb, p)]

        def fn(*a: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return eagle3_step(head, cache, ops, env, depths, *a)

        out = gb.get("step", b, p, example, fn)(tokens, feats, count, ctx0, table)
        return tuple(x[:real].clone() for x in out)
