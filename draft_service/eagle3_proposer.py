"""The ``eagle3`` method: an EAGLE-3 head drafts trees from the target's own features.

A FeatureDrafter (draft_service/feature_drafter.py: unit t is the committed pair
``(s_{t+1}, f_t)`` at position t). One step, batched over sequences (one head
forward each):

1. *catch up*: a chain chunk of the committed pairs without KV (at least the last,
   ``(s_n, f_{n-1})`` at position n-1, which is recomputed for its output); its
   input hidden is ``fc(f)``. The last output ``o`` gives level 1's log-probs.
2. *expand*: ``depth - 1`` tree chunks of tree_build.Expansion's frontier nodes as
   scratch after the committed pairs: a node at level l sits at position n-1+l,
   its token the draft token mapped to a target id, its hidden its parent's output
   (``o`` for level 1) instead of target features — the EAGLE-3 test-time rule.
3. *rerank* to ``num_nodes``; draft ids go back to target ids through ``d2t``.

Lookahead (draft_service/lookahead.py): a guessed token has no target feature until the
verify has run, so ``guess`` gives guessed pairs the head's own outputs as features, by
the same test-time rule as the tree's deeper levels: the output at the newest committed
pair for the first guessed token, each next the output at the guessed pair before it
(one head forward a guessed token; their KV is written), after the committed pairs a hit
step left without KV (it drafted nothing), from their target features. ``update`` with
fewer tokens takes the guessed pairs back, and their pages never join the prefix cache.

Rollback is free: tree nodes' KV was computed from the head's own outputs, never
from target features, so none of it is kept. The next update's accepted tokens
arrive with their target features and join the committed pairs in the next
catch-up (accepted_nodes are not needed). Example, chain, committed ``a b r``:
pairs (b, f_a) at 0, (r, f_b) at 1; the tree ``x y`` is scratch at 2, 3. The target
accepts ``x`` and adds bonus ``z``; the update brings ``x`` with f_r and ``z`` with
f_x, so the catch-up chunk is ``(x, f_r), (z, f_x)`` at 2, 3.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch

from treespec.common.runtime.block_manager import OutOfPages
from treespec.common.runtime.forward_batch import build_forward_batch, chain_chunk
from treespec.common.model.paths import resolve_model
from treespec.common.spec.tree import TreeEnvelope, shallower
from treespec.draft_service.eagle3_head import Eagle3Head
from treespec.draft_service.eagle3_step import eagle3_step
from treespec.draft_service.feature_drafter import FeatureDrafter, FeatureSeq
from treespec.draft_service.model_step import level_depths
from treespec.kernels.dispatch import select

if TYPE_CHECKING:
    from treespec.draft_service.config import DraftConfig


class Eagle3Proposer(FeatureDrafter):
    name = "eagle3"
    levels = True
    lookahead = True            # guess() extends, update() takes back

    def __init__(self, head: Eagle3Head, env: TreeEnvelope, ops: ModuleType,
                 num_blocks: int, block_size: int, model_name: str = "",
                 prefix_caching: bool = True) -> None:
        if env.topk > head.spec.draft_vocab_size:
            raise ValueError(f"topk {env.topk} exceeds the draft vocabulary "
                             f"({head.spec.draft_vocab_size})")
        self.head = head
        self.vocab_size = head.spec.vocab_size
        self.target_hidden_layers = head.spec.aux_layer_ids
        self._depths = level_depths(env, head.device)
        prefix = f"{self.name}|{model_name}|{head.spec!r}" if prefix_caching else None
        super().__init__(head.new_cache(num_blocks, block_size, prefix), env, ops, model_name,
                         [((self.feature_size,), head.dtype)])

    @classmethod
    def load(cls, cfg: DraftConfig, device: torch.device, dtype: torch.dtype) -> Eagle3Proposer:
        head = Eagle3Head.from_pretrained(resolve_model(cfg.model), cfg.target_embeddings,
                                          dtype, device)
        return cls(head, cfg.envelope, select(device, cfg.kernels), cfg.num_blocks,
                   cfg.block_size, model_name=cfg.model, prefix_caching=cfg.prefix_caching)

    # ------------------------------------------------------------ KVDrafter hooks
    def _prefill(self, rows: list[tuple[FeatureSeq, int, int]]) -> None:
        fb = build_forward_batch([chain_chunk(st.pages, st.tokens[lo + 1:hi + 1])
                                  for st, lo, hi in rows], self.cache)
        feats = torch.cat([st.feats.rows[lo:hi] for st, lo, hi in rows])
        self.head(fb, self.cache, self.ops, feats)

    def _step_fn(self, tokens: torch.Tensor, count: torch.Tensor, ctx0: torch.Tensor,
                 table: torch.Tensor, feats: torch.Tensor,
                 sampling: list[torch.Tensor] | None = None, depth: int = 0
                 ) -> tuple[torch.Tensor, ...]:
        return eagle3_step(self.head, self.cache, self.ops,
                           shallower(self.env, depth or self.env.depth), self._depths, tokens,
                           count, ctx0, table, feats, sampling)

    def _room(self, st: FeatureSeq, units: int) -> bool:
        """Whether st holds (or could get) pages for units and a tree's scratch."""
        try:
            self.cache.reserve(st.pages, units + self._scratch)
        except OutOfPages:
            return False
        return True

    @torch.inference_mode()
    def guess(self, items: list[tuple[int, list[int], int]]) -> None:
        """Each (seq_id, tokens, count): the sequence's tokens extended by count guessed
        tokens, whose pairs take the head's outputs as features (module doc). A sequence
        whose committed pairs lack KV (dropped for pages) gets zero features instead."""
        chains = []                 # (state, all its tokens, the units to forward)
        behind = []                 # committed pairs without KV (a hit's: it drafted nothing)
        for sid, tokens, count in items:
            st = self.state(sid)
            if len(st.tokens) != len(tokens) - count:      # another guess's, taken back
                self.update(sid, tokens[:len(tokens) - count], 0, [], None)
            n = len(st.tokens) - 1              # its pairs; pair n-1 is redone
            if count and n >= 1 and n - 1 - st.pages.kv_len < self.graphs.catch_up_len \
                    and self._room(st, len(tokens) - 1):
                if st.pages.kv_len < n - 1:
                    behind.append((st, st.pages.kv_len, n - 1))
                else:
                    self.cache.rewind(st.pages, n - 1)
                chains.append((st, tokens, tokens[n:n + count]))    # s_n, then guesses
            elif count:
                self.update(sid, tokens, count, [], None)
                st.guessed = True
        if behind:
            self._prefill(behind)
            for st, _, hi in behind:
                st.pages.kv_len = hi
        if not chains:
            return
        hidden = torch.cat([st.feats.span(len(st.tokens) - 2, len(st.tokens) - 1)
                            for st, _, _ in chains])
        rows: list[list[torch.Tensor]] = [[] for _ in chains]
        for j in range(max(len(u) for _, _, u in chains)):
            live = [i for i, (_, _, u) in enumerate(chains) if len(u) > j]
            fb = build_forward_batch([chain_chunk(chains[i][0].pages, chains[i][2][j:j + 1])
                                      for i in live], self.cache)
            out = self.head(fb, self.cache, self.ops, hidden[live])
            hidden = hidden.index_copy(0, torch.tensor(live, device=hidden.device), out)
            for k, i in enumerate(live):
                chains[i][0].pages.kv_len += 1
                rows[i].append(out[k])
        for (st, tokens, _), r in zip(chains, rows):
            st.feats.append(torch.stack(r))
            st.tokens, st.guessed = tokens, True
