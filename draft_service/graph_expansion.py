"""The draft model's tree expansion at a fixed shape, captured per batch bucket.

``expand`` is everything after the catch-up forward: EAGLE-2 expansion over
depth - 1 tree chunks (``tree_build.Expansion``) and the rerank, entirely on the
device. Its shapes depend only on (B, P) for a given envelope, so
``GraphExpander`` captures it once per (batch bucket, page bucket) with
``common.cuda_graph.StaticGraph`` and replays it; padding rows sit on a scratch
page and their trees are dropped. On the CPU it runs the same function eagerly.
"""

from __future__ import annotations

from types import ModuleType

import torch

from common.cuda_graph import StaticGraph
from common.forward_batch import device_forward_batch, page_table
from common.kv_cache import PagedKVCache, SeqPages
from common.qwen3 import Qwen3Model
from common.tree import TreeEnvelope
from draft_service.tree_build import Expansion

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


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


class GraphExpander:
    def __init__(self, net: Qwen3Model, cache: PagedKVCache, ops: ModuleType,
                 env: TreeEnvelope, capture: bool = True) -> None:
        self.net, self.cache, self.ops, self.env = net, cache, ops, env
        self.capture = capture
        self.scratch = cache.blocks.allocate(1)[0]        # padding rows write here
        self.depths = level_depths(env, cache.device)
        self.graphs: dict[tuple[int, int], StaticGraph] = {}
        self._pool: object | None = None

    def _graph(self, b: int, p: int, vocab: int) -> StaticGraph:
        """As the verify step's: a new page bucket captures every smaller batch
        bucket too, so a shrinking batch never stalls on a capture."""
        if (b, p) not in self.graphs:
            for smaller in BATCH_BUCKETS:
                if smaller < b:
                    self._capture(smaller, p, vocab)
        return self._capture(b, p, vocab)

    def _capture(self, b: int, p: int, vocab: int) -> StaticGraph:
        g = self.graphs.get((b, p))
        if g is None:
            dev = self.cache.device
            example = [torch.zeros((b, vocab), dtype=torch.float32, device=dev),
                       torch.zeros(b, dtype=torch.int32, device=dev),
                       torch.full((b, p), self.scratch, dtype=torch.int32, device=dev)]

            def fn(*a: torch.Tensor) -> tuple[torch.Tensor, ...]:
                return expand(self.net, self.cache, self.ops, self.env, self.depths, *a)

            with torch.inference_mode():
                g = StaticGraph(fn, example, capture=self.capture, pool=self._pool)
            self._pool = g.pool or self._pool
            self.graphs[(b, p)] = g
        return g

    @torch.inference_mode()
    def __call__(self, logp: torch.Tensor, pages: list[SeqPages]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Trees for the real rows: logp [R, V] on the device, pages of R sequences."""
        real, vocab = logp.shape
        b = next(x for x in BATCH_BUCKETS + (real,) if x >= real)
        width = max(len(sp.pages) for sp in pages)
        p = 1 << max(0, (width - 1).bit_length())
        dev = self.cache.device
        full_logp = torch.zeros((b, vocab), dtype=torch.float32, device=dev)
        full_logp[:real] = logp.float()
        ctx = torch.zeros(b, dtype=torch.int32)
        ctx[:real] = torch.tensor([sp.kv_len for sp in pages])
        table = torch.full((b, p), self.scratch, dtype=torch.int32)
        table[:real, :width] = page_table(pages, torch.device("cpu"), fill=self.scratch)
        if dev.type == "cuda":
            ctx, table = ctx.pin_memory(), table.pin_memory()
        tokens, parents, chunk_pos = self._graph(b, p, vocab)(full_logp, ctx, table)
        return tokens[:real].clone(), parents[:real].clone(), chunk_pos[:real].clone()
