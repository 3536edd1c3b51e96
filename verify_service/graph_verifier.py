"""The verify step on the GPU: ``fixed_step`` captured once per (batch, pages) bucket.

Same interface as ``verifier.Verifier`` (prefill, step), chosen once by the engine.
A step pads its batch to the next batch bucket (rows on a scratch page, all
padding) and its page tables to the next power-of-two width, copies the inputs
through one pinned buffer, replays, and reads back accepted / num / bonus in one
device-to-host copy: one host sync per step.
"""

from __future__ import annotations

from types import ModuleType

import torch

from common.graph_buckets import BucketedGraphs
from common.kv_cache import PagedKVCache, SeqPages
from common.qwen3 import Qwen3Model
from verify_service.device_step import fixed_step
from verify_service.verifier import StepResult, Verifier

PAD = -2


class GraphVerifier(Verifier):
    reserved_pages = 1

    def __init__(self, model: Qwen3Model, cache: PagedKVCache, ops: ModuleType,
                 capture: bool = True) -> None:
        super().__init__(model, cache, ops)
        self.buckets = BucketedGraphs(cache, capture)

    @property
    def graphs(self) -> dict:
        """Captured graphs by ((nodes, capture layers), batch bucket, page bucket)."""
        return self.buckets.graphs

    @torch.inference_mode()
    def step(self, pages: list[SeqPages], roots: list[int], tokens: torch.Tensor | None,
             parents: torch.Tensor | None, depth: int) -> StepResult:
        real = len(pages)
        n = 0 if tokens is None else tokens.shape[1]
        for sp in pages:
            self.cache.reserve(sp, sp.kv_len + n + 1)
        gb = self.buckets
        b, p, table = gb.shape(pages)
        host_roots = torch.zeros(b, dtype=torch.int64)
        host_roots[:real] = torch.tensor(roots)
        host_tokens = torch.zeros((b, n), dtype=torch.int32)
        host_parents = torch.full((b, n), PAD, dtype=torch.int32)
        if n:
            host_tokens[:real], host_parents[:real] = tokens, parents
        ctx = torch.zeros(b, dtype=torch.int32)
        ctx[:real] = torch.tensor([sp.kv_len for sp in pages])
        walk, cap, dev = (depth if n else 0), self.capture_layers, self.cache.device

        def example(bb: int) -> list[torch.Tensor]:
            return [torch.zeros(bb, dtype=torch.int64, device=dev),
                    torch.zeros((bb, n), dtype=torch.int32, device=dev),
                    torch.full((bb, n), PAD, dtype=torch.int32, device=dev),
                    torch.zeros(bb, dtype=torch.int32, device=dev), gb.table_example(bb, p)]

        def fn(*a: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return fixed_step(self.model, self.cache, self.ops, walk, cap, *a)

        graph = gb.get((n, cap), b, p, example, fn)
        accepted, num, bonus, *path = graph(*gb.host(host_roots, host_tokens, host_parents,
                                                      ctx, table))
        out = torch.cat([accepted.long().view(-1), num.long(), bonus.long()]).cpu()
        d = accepted.shape[1]
        acc_l = out[:b * d].view(b, d).tolist()
        num_l = out[b * d:b * d + b].tolist()
        bonus_l = out[b * d + b:].tolist()
        for i, sp in enumerate(pages):
            sp.kv_len += 1 + num_l[i]
        rows = [path[0][i, :1 + num_l[i]].clone() for i in range(real)] if path else None
        return StepResult([acc_l[i][:num_l[i]] for i in range(real)], bonus_l[:real], rows)
