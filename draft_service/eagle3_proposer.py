"""The ``eagle3`` method: an EAGLE-3 head drafts trees from the target's own features.

Alignment. With committed tokens ``s_0 .. s_n`` and target features ``f_t`` (the
named layers' states at token ``s_t``, i.e. the state that predicted ``s_{t+1}``),
the head's KV slot / position ``t`` holds the *committed pair* ``(s_{t+1}, f_t)``,
t = 0 .. n-1. The verify service sends, with each new token ``s_j``, the row
``f_{j-1}`` (a full update's row 0 belongs to ``s_0``, which has no pair), so every
committed token completes its pair on arrival.

One step, batched over sequences (one head forward each):

1. *catch up*: a chain chunk of the committed pairs without KV (at least the last,
   ``(s_n, f_{n-1})`` at position n-1, which is recomputed for its output); its
   input hidden is ``fc(f)``. The last output ``o`` gives level 1's log-probs.
2. *expand*: ``depth - 1`` tree chunks of tree_build.Expansion's frontier nodes as
   scratch after the committed pairs: a node at level l sits at position n-1+l,
   its token the draft token mapped to a target id, its hidden its parent's output
   (``o`` for level 1) instead of target features — the EAGLE-3 test-time rule.
3. *rerank* to ``num_nodes``; draft ids go back to target ids through ``d2t``.

Rollback is free: tree nodes' KV was computed from the head's own outputs, never
from target features, so none of it is kept. The next update's accepted tokens
arrive with their target features and join the committed pairs in the next
catch-up (accepted_nodes are not needed). Example, chain, committed ``a b r``:
pairs (b, f_a) at 0, (r, f_b) at 1; the tree ``x y`` is scratch at 2, 3. The target
accepts ``x`` and adds bonus ``z``; the update brings ``x`` with f_r and ``z`` with
f_x, so the catch-up chunk is ``(x, f_r), (z, f_x)`` at 2, 3.

Only the newest committed pair's feature row is kept between steps; a sequence
whose pages run out proposes padding (its KV and pending rows stay) and catches up
when pages free. A missing hidden tensor counts as zero features (worse drafts, the
same output).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from types import ModuleType

import torch

from common.block_manager import OutOfPages
from common.devices import bind_device, pick_device, pick_dtype
from common.errors import InvalidRequest
from common.forward_batch import build_forward_batch, chain_chunk, page_table
from common.kv_cache import PagedKVCache, SeqPages
from common.model_paths import resolve_model
from common.tree import TreeEnvelope
from draft_service.config import DraftConfig
from draft_service.eagle3_head import Eagle3Head
from draft_service.eagle3_step import Eagle3Graphs, expand_eagle3
from draft_service.graph_expansion import level_depths
from draft_service.proposer import padding_trees
from kernels.dispatch import select

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    pages: SeqPages = field(default_factory=SeqPages)   # kv_len = committed pairs in KV
    tokens: list[int] = field(default_factory=list)     # the engine's committed list
    feat_base: int = 0                                   # pair position of feats[0]
    feats: list[torch.Tensor] = field(default_factory=list)  # [*, C] rows of feat_base..


class Eagle3Proposer:
    name = "eagle3"
    light = False

    def __init__(self, head: Eagle3Head, env: TreeEnvelope, ops: ModuleType,
                 num_blocks: int, block_size: int, model_name: str = "") -> None:
        if env.topk > head.spec.draft_vocab_size:
            raise ValueError(f"topk {env.topk} exceeds the draft vocabulary "
                             f"({head.spec.draft_vocab_size})")
        self.head, self.env, self.ops = head, env, ops
        self.cache: PagedKVCache = head.new_cache(num_blocks, block_size)
        self.vocab_size = head.spec.vocab_size
        self.target_hidden_layers: tuple[int, ...] = head.spec.aux_layer_ids
        self.model = model_name
        self._seqs: OrderedDict[int, _Seq] = OrderedDict()
        # on a GPU a draft step replays a CUDA graph per batch bucket
        self.graphs = Eagle3Graphs(head, self.cache, ops, env) \
            if head.device.type == "cuda" else None
        self._depths = level_depths(env, head.device)

    @classmethod
    def from_config(cls, cfg: DraftConfig) -> "Eagle3Proposer":
        device = pick_device(cfg.device)
        bind_device(device)      # graphs and pinned staging land on it, as for the draft model
        head = Eagle3Head.from_pretrained(resolve_model(cfg.model), cfg.target_embeddings,
                                          pick_dtype(cfg.dtype, device), device)
        return cls(head, cfg.envelope, select(device, cfg.kernels), cfg.num_blocks,
                   cfg.block_size, model_name=cfg.model)

    # ------------------------------------------------------------ state
    def update(self, seq_id: int, tokens: list[int], new_count: int,
               accepted_nodes: list[int], hidden: torch.Tensor | None) -> None:
        c = self.head.spec.feature_size
        if hidden is None:
            hidden = torch.zeros(new_count, c)
        elif hidden.dim() != 2 or hidden.shape != (new_count, c):
            raise InvalidRequest(
                f"seq {seq_id}: hidden states of shape {tuple(hidden.shape)}, the EAGLE-3 "
                f"head needs [{new_count}, {c}] (layers {list(self.target_hidden_layers)} of "
                "the target it was trained for)")
        st = self._seqs.setdefault(seq_id, _Seq())
        self._seqs.move_to_end(seq_id)
        old = len(tokens) - new_count
        rows = hidden.to(self.head.device, self.head.dtype, non_blocking=True)
        if old == 0:
            self.cache.release(st.pages)
            st.feat_base, st.feats = 0, []
            rows = rows[1:]          # s_0 has no pair
        if rows.shape[0]:
            st.feats.append(rows)
        st.tokens = tokens

    def release(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is not None:
            self.cache.release(st.pages)

    # ------------------------------------------------------------ propose
    def propose(self, seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, parents = padding_trees(len(seq_ids), self.env.num_nodes)
        rows = self._reserve(seq_ids)
        if not rows:
            return tokens, parents
        t, p = self._draft([self._seqs[seq_ids[r]] for r in rows])
        tokens[rows], parents[rows] = t.cpu(), p.cpu()
        return tokens, parents

    def _reserve(self, seq_ids: list[int]) -> list[int]:
        """Rows that can draft: at least one committed pair and pages for all pairs
        plus the scratch tree. A row that does not fit is padding this step."""
        # past the committed pairs: the tree's scratch, and the padded tail of a
        # fixed-shape catch-up (up to depth slots after a one-pair catch-up)
        scratch = max((self.env.depth - 1) * self.env.topk, self.env.depth)
        rows = []
        for r, s in enumerate(seq_ids):
            st = self._seqs[s]
            pairs = len(st.tokens) - 1
            if pairs < 1:
                continue
            try:
                self.cache.reserve(st.pages, pairs + scratch)
            except OutOfPages:
                log.debug("seq %d: no draft KV pages this step", s)
                continue
            rows.append(r)
        return rows

    @torch.inference_mode()
    def _draft(self, seqs: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Catch up, expand and rerank: tokens, parents [B, N] int32 (target ids).
        In steady state (at most depth + 1 new pairs a row) on a GPU this is one
        graph replay (eagle3_step); a longer catch-up runs eagerly first."""
        head, env, ops = self.head, self.env, self.ops
        new_tokens, new_feats = [], []
        for st in seqs:
            pairs = len(st.tokens) - 1
            st.pages.kv_len = min(st.pages.kv_len, pairs - 1)
            rows = torch.cat(st.feats) if len(st.feats) > 1 else st.feats[0]
            new_feats.append(rows[st.pages.kv_len - st.feat_base:])
            new_tokens.append(st.tokens[st.pages.kv_len + 1:])
            st.feat_base, st.feats = pairs - 1, [rows[-1:].clone()]
        pages = [st.pages for st in seqs]
        if self.graphs is not None and max(map(len, new_tokens)) <= self.graphs.catch_up_len:
            out = self.graphs(new_tokens, new_feats, pages)
        else:
            fb = build_forward_batch([chain_chunk(sp, t) for sp, t in zip(pages, new_tokens)],
                                     self.cache)
            root = head(fb, self.cache, ops, head.features(torch.cat(new_feats)))[fb.last]
            dev = self.cache.device
            ctx = torch.tensor([len(st.tokens) - 1 for st in seqs], dtype=torch.int32, device=dev)
            out = expand_eagle3(head, self.cache, ops, env, self._depths, root, ctx,
                                page_table(pages, dev))
        for st in seqs:
            st.pages.kv_len = len(st.tokens) - 1
        return out
