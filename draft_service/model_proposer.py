"""The ``model`` method: a small Qwen3 drafts trees over its own paged KV.

Per sequence the proposer keeps a SeqPages whose ``kv_len`` slots hold draft KV
of committed tokens, and the tree it emitted last. One step, batched over all
sequences with one forward each:

1. *catch up*: a chain chunk over the committed tokens without draft KV (at
   least the root, the last committed token). Afterwards kv_len == committed
   length; the root's logits give level 1.
2. *expand*: ``depth - 1`` tree chunks of the frontier nodes so far, written as
   scratch after kv_len (see tree_build.Expansion for which nodes).
3. *rerank* to ``num_nodes`` and emit.

Rollback on the next update: of the accepted path (node indices into the last
tree), the prefix whose nodes were in the last expansion chunk has valid KV in
scratch slots ``kv_len + chunk_pos``; it is moved to ``kv_len + i`` (one
compact_kv for the batch, before the next catch-up) and kv_len advances by its
length. Example, depth 3, topk 1, committed ``... r``, tree ``a b c``, chunk
``[a, b]`` at slots L, L+1: the target accepts ``a b c`` and adds bonus x, so
``a b`` already sit at L, L+1 (no move), kv_len = L + 2 and the catch-up chunk
is ``[c, x]``. Anything that does not check out (path not in the tree, tokens
not the committed ones) is simply recomputed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from types import ModuleType

import torch

from common.block_manager import OutOfPages
from common.devices import bind_device, pick_device, pick_dtype
from common.forward_batch import build_forward_batch, chain_chunk, page_table
from common.kv_cache import PagedKVCache, SeqPages
from common.model_paths import resolve_model
from common.qwen3 import Qwen3Model
from common.tree import ROOT, TreeEnvelope
from draft_service.config import DraftConfig
from draft_service.proposer import padding_trees
from draft_service.graph_expansion import GraphExpander, expand, level_depths
from kernels.dispatch import select


@dataclass
class _Seq:
    pages: SeqPages = field(default_factory=SeqPages)
    tokens: list[int] = field(default_factory=list)   # the engine's committed list
    tree_base: int = -1                               # committed length the last tree hung off
    tree_tokens: list[int] = field(default_factory=list)
    tree_parents: list[int] = field(default_factory=list)
    tree_chunk: list[int] = field(default_factory=list)  # chunk position per node, -1 none
    moves: list[tuple[int, int]] = field(default_factory=list)  # pending (src, dst) slots


class ModelProposer:
    name = "model"
    light = False

    def __init__(self, model: Qwen3Model, env: TreeEnvelope, ops: ModuleType,
                 num_blocks: int, block_size: int, model_name: str = "") -> None:
        if env.topk > model.spec.vocab_size:
            raise ValueError(f"topk {env.topk} exceeds the draft vocabulary")
        self.net, self.env, self.ops = model, env, ops
        self.cache: PagedKVCache = model.new_cache(num_blocks, block_size)
        self.vocab_size = model.spec.vocab_size
        self.target_hidden_layers: tuple[int, ...] = ()
        self.model = model_name
        self._seqs: OrderedDict[int, _Seq] = OrderedDict()
        # on a GPU the expansion replays a CUDA graph per batch bucket
        self.expander = GraphExpander(model, self.cache, ops, env) \
            if model.device.type == "cuda" else None
        self._depths = level_depths(env, model.device)

    @classmethod
    def from_config(cls, cfg: DraftConfig) -> "ModelProposer":
        device = pick_device(cfg.device)
        bind_device(device)
        model = Qwen3Model.from_pretrained(resolve_model(cfg.model), pick_dtype(cfg.dtype, device),
                                           device)
        return cls(model, cfg.envelope, select(device, cfg.kernels), cfg.num_blocks,
                   cfg.block_size, model_name=cfg.model)

    # ------------------------------------------------------------ state
    def update(self, seq_id: int, tokens: list[int], new_count: int,
               accepted_nodes: list[int], hidden: torch.Tensor | None) -> None:
        st = self._seqs.setdefault(seq_id, _Seq())
        self._seqs.move_to_end(seq_id)
        old = len(tokens) - new_count
        st.pages.kv_len = min(st.pages.kv_len, old)
        keep = self._kept_prefix(st, tokens, old, accepted_nodes) if st.tree_base == old else []
        st.moves += [(old + c, old + i) for i, c in enumerate(keep) if c != i]
        st.pages.kv_len += len(keep)
        st.tokens, st.tree_base = tokens, -1

    @staticmethod
    def _kept_prefix(st: _Seq, tokens: list[int], old: int, path: list[int]) -> list[int]:
        """Chunk positions of the accepted path's leading nodes whose scratch KV
        is valid: in the last tree, root-to-leaf, equal to the committed tokens
        and forwarded in the last expansion chunk."""
        keep: list[int] = []
        prev = ROOT
        for i, n in enumerate(path):
            ok = (0 <= n < len(st.tree_tokens) and st.tree_parents[n] == prev
                  and old + i < len(tokens) and st.tree_tokens[n] == tokens[old + i]
                  and st.tree_chunk[n] >= 0)
            if not ok:
                break
            keep.append(st.tree_chunk[n])
            prev = n
        return keep

    def release(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is not None:
            self.cache.release(st.pages)

    def _drop_kv(self, st: _Seq) -> None:
        """Forget a sequence's draft KV (it is recomputed when next proposed)."""
        self.cache.release(st.pages)
        st.moves, st.tree_base = [], -1

    # ------------------------------------------------------------ propose
    def propose(self, seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, parents = padding_trees(len(seq_ids), self.env.num_nodes)
        self._apply_moves()
        rows = self._reserve(seq_ids)
        if not rows:
            return tokens, parents
        seqs = [self._seqs[seq_ids[r]] for r in rows]
        t, p, chunk_pos = self._draft(seqs)
        for st, tt, pp, cc in zip(seqs, t.tolist(), p.tolist(), chunk_pos.tolist()):
            st.tree_base = len(st.tokens)
            st.tree_tokens, st.tree_parents, st.tree_chunk = tt, pp, cc
        tokens[rows], parents[rows] = t.cpu(), p.cpu()
        return tokens, parents

    def _apply_moves(self) -> None:
        src: list[int] = []
        dst: list[int] = []
        for st in self._seqs.values():
            for s, d in st.moves:
                src.append(self.cache.slot(st.pages, s))
                dst.append(self.cache.slot(st.pages, d))
            st.moves = []
        if src:
            dev = self.cache.device
            self.ops.compact_kv(self.cache.k, self.cache.v,
                                torch.tensor(src, dtype=torch.int64, device=dev),
                                torch.tensor(dst, dtype=torch.int64, device=dev))

    def _reserve(self, seq_ids: list[int]) -> list[int]:
        """Rows whose sequence has pages for catch-up plus scratch. When pages run
        out, idle sequences' KV is dropped, least recently used first; a row
        that still does not fit is left as padding."""
        # past the committed tokens: the tree's scratch, and the padded tail of a
        # fixed-shape catch-up (up to depth slots after a one-token catch-up)
        scratch = max((self.env.depth - 1) * self.env.topk, self.env.depth)
        batch = set(seq_ids)
        rows = []
        for r, s in enumerate(seq_ids):
            st = self._seqs[s]
            while True:
                try:
                    self.cache.reserve(st.pages, len(st.tokens) + scratch)
                    rows.append(r)
                    break
                except OutOfPages:
                    idle = next((v for k, v in self._seqs.items()
                                 if k not in batch and v.pages.pages), None)
                    self._drop_kv(idle if idle is not None else st)
                    if idle is None:
                        break
        return rows

    @torch.inference_mode()
    def _draft(self, seqs: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Catch up, expand and rerank: tokens, parents [B, N] int32, chunk_pos [B, N]."""
        env = self.env
        for st in seqs:
            st.pages.kv_len = min(st.pages.kv_len, len(st.tokens) - 1)
        news = [st.tokens[st.pages.kv_len:] for st in seqs]
        if self.expander is not None and max(map(len, news)) <= self.expander.catch_up_len:
            out = self.expander.step(news, [st.pages for st in seqs])    # one replay
            for st in seqs:
                st.pages.kv_len = len(st.tokens)
            return out
        chunks = [chain_chunk(st.pages, new) for st, new in zip(seqs, news)]
        fb = build_forward_batch(chunks, self.cache)
        hidden, _ = self.net(fb, self.cache, self.ops)                 # [T, H]
        logp = self.net.logits(hidden[fb.last]).log_softmax(-1)       # [B, V]
        for st in seqs:
            st.pages.kv_len = len(st.tokens)
        if self.expander is not None:
            return self.expander(logp, [st.pages for st in seqs])
        dev = self.cache.device
        ctx = torch.tensor([st.pages.kv_len for st in seqs], dtype=torch.int32, device=dev)
        return expand(self.net, self.cache, self.ops, env, self._depths, logp, ctx,
                      page_table([st.pages for st in seqs], dev))
