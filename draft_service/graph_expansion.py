"""The draft model's tree expansion at a fixed shape, captured per batch bucket.

``expand`` is everything after the catch-up forward: EAGLE-2 expansion over
depth - 1 tree chunks (``tree_build.Expansion``) and the rerank, entirely on the
device. Its shapes depend only on (B, P) for a given envelope, so
``GraphExpander`` captures it once per (batch bucket, page bucket) with
``common.cuda_graph.StaticGraph`` and replays it; padding rows sit on a scratch
page and their trees are dropped. On the CPU it runs the same function eagerly.

``catch_up_and_expand`` puts the catch-up forward in front of it at a fixed shape:
in steady state a sequence brings at most depth + 1 uncommitted tokens (the
accepted path and the bonus), so the catch-up is a [B, depth + 1] chain with the
unused tail as padding, and a whole draft step is one graph replay. A longer
catch-up (a new prompt, a resync) runs eagerly first.
"""

from __future__ import annotations

from types import ModuleType

import torch

from common.forward_batch import device_forward_batch, padded_chain_batch
from common.graph_buckets import BucketedGraphs
from common.kv_cache import PagedKVCache, SeqPages
from common.qwen3 import Qwen3Model
from common.tree import TreeEnvelope
from draft_service.tree_build import Expansion

def level_depths(env: TreeEnvelope, device: torch.device) -> list[torch.Tensor]:
    """Position offsets of each expansion chunk (levels 1..depth-1), made up front
    so nothing is copied from the host inside a capture."""
    return [torch.tensor([lv for lv in range(level) for _ in range(env.topk)], device=device)
            for level in range(1, env.depth)]


def expand(net: Qwen3Model, cache: PagedKVCache, ops: ModuleType, env: TreeEnvelope,
           depths: list[torch.Tensor], logp: torch.Tensor, ctx: torch.Tensor,
           table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logp [B, V] root next-token log-probs, ctx [B] int32 draft kv_len (the root's
    KV written), table [B, P] int32 -> tokens, parents [B, N] int32, chunk_pos [B, N]."""
    b = logp.shape[0]
    exp = Expansion(logp, env.topk, env.depth)
    for level in range(1, env.depth):
        tok, par, _ = exp.chunk(level)                                    # [B, level*K]
        fb = device_forward_batch(tok, par, depths[level - 1], ctx, table, cache.block_size)
        hidden, _ = net(fb, cache, ops)                                   # [B*level*K, H]
        newest = hidden.view(b, level * env.topk, -1)[:, (level - 1) * env.topk:]
        exp.grow(level, net.logits(newest).log_softmax(-1))               # [B, K, V]
    return exp.rerank(env.num_nodes)


def catch_up_and_expand(net: Qwen3Model, cache: PagedKVCache, ops: ModuleType,
                        env: TreeEnvelope, depths: list[torch.Tensor], tokens: torch.Tensor,
                        count: torch.Tensor, ctx0: torch.Tensor, table: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B, C] int64 whose first count[b] (>= 1) are row b's uncommitted
    tokens, ctx0 [B] int32 the draft KV length before them, table [B, P] int32
    covering ctx0 + C + the expansion's scratch -> expand's outputs. The tail past
    count[b] is padding: it sees only itself, nobody sees it, and the slots it
    writes lie past the committed length (the expansion overwrites or never reads
    them)."""
    b, c = tokens.shape
    fb = padded_chain_batch(tokens, count, ctx0, table, cache.block_size)
    hidden, _ = net(fb, cache, ops)                                              # [B*C, H]
    last = hidden.view(b, c, -1)[torch.arange(b, device=tokens.device), count.long() - 1]
    logp = net.logits(last).log_softmax(-1)                                      # [B, V]
    return expand(net, cache, ops, env, depths, logp, ctx0 + count, table)


class GraphExpander:
    """The draft model's fixed-shape step functions, one graph per (batch bucket,
    page bucket): ``step`` (catch-up + expansion) and ``__call__`` (expansion
    after an eager catch-up)."""

    def __init__(self, net: Qwen3Model, cache: PagedKVCache, ops: ModuleType,
                 env: TreeEnvelope, capture: bool = True) -> None:
        self.net, self.cache, self.ops, self.env = net, cache, ops, env
        self.buckets = BucketedGraphs(cache, capture)
        self.depths = level_depths(env, cache.device)
        self.catch_up_len = env.depth + 1       # longest catch-up the step graphs take

    @torch.inference_mode()
    def step(self, new_tokens: list[list[int]], pages: list[SeqPages]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Catch-up and expansion in one replay: new_tokens[r] (1 .. catch_up_len
        tokens) are row r's uncommitted tokens, written from pages[r].kv_len on.
        Advancing kv_len is the caller's."""
        gb, dev, c = self.buckets, self.cache.device, self.catch_up_len
        real = len(pages)
        b, p, table = gb.shape(pages)
        tokens, count, ctx0 = gb.chain_inputs(new_tokens, pages, b, c)

        def example(bb: int) -> list[torch.Tensor]:
            return [torch.zeros((bb, c), dtype=torch.int64, device=dev),
                    torch.ones(bb, dtype=torch.int32, device=dev),
                    torch.zeros(bb, dtype=torch.int32, device=dev), gb.table_example(bb, p)]

        def fn(*a: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return catch_up_and_expand(self.net, self.cache, self.ops, self.env, self.depths,
                                       *a)

        out = gb.get("step", b, p, example, fn)(tokens, count, ctx0, table)
        return tuple(x[:real].clone() for x in out)

    @torch.inference_mode()
    def __call__(self, logp: torch.Tensor, pages: list[SeqPages]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Trees for the real rows: logp [R, V] on the device, pages of R sequences."""
        gb, dev = self.buckets, self.cache.device
        real, vocab = logp.shape
        b, p, table = gb.shape(pages)
        full_logp = torch.zeros((b, vocab), dtype=torch.float32, device=dev)
        full_logp[:real] = logp.float()
        ctx = torch.zeros(b, dtype=torch.int32)
        ctx[:real] = torch.tensor([sp.kv_len for sp in pages])

        def example(bb: int) -> list[torch.Tensor]:
            return [torch.zeros((bb, vocab), dtype=torch.float32, device=dev),
                    torch.zeros(bb, dtype=torch.int32, device=dev), gb.table_example(bb, p)]

        def fn(*a: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return expand(self.net, self.cache, self.ops, self.env, self.depths, *a)

        out = gb.get("expand", b, p, example, fn)(full_logp, ctx, table)
        return tuple(x[:real].clone() for x in out)
