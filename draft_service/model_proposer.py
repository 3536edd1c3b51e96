"""The ``model`` method: a small Qwen3 drafts trees over its own paged KV.

A KVDrafter (draft_service/kv_drafter.py) whose units are committed tokens: slot t
holds the draft KV of token t, and a step catches up from the newest KV-less token
(at least the root, the last committed one), whose logits give level 1, then
expands ``depth - 1`` tree chunks of frontier nodes as scratch after the committed
tokens (tree_build.Expansion) and reranks to ``num_nodes`` (model_step).

Rollback on the next update: of the accepted path (node indices into the last
tree), the prefix whose nodes were in the last expansion chunk has valid KV in
scratch slots ``kv_len + chunk_pos``; it is moved to ``kv_len + i`` (one
compact_kv for the batch, before the next step's forwards) and kv_len advances by
its length. Example, depth 3, topk 1, committed ``... r``, tree ``a b c``, chunk
``[a, b]`` at slots L, L+1: the target accepts ``a b c`` and adds bonus x, so
``a b`` already sit at L, L+1 (no move), kv_len = L + 2 and the catch-up chunk
is ``[c, x]``. Anything that does not check out (path not in the tree, tokens
not the committed ones) is simply recomputed.

Prefix caching (on unless ``--no-prefix-caching``): the draft's full KV pages are
shared by the keys of their tokens (common/runtime/prefix_cache.py, as on the verify
service), so a sequence whose prompt starts like an earlier one catches up only on the
rest (KVDrafter._reserve, ``prefix_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from treespec.common.runtime.forward_batch import build_forward_batch, chain_chunk
from treespec.common.model.paths import resolve_model
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.spec.tree import ROOT, TreeEnvelope, shallower
from treespec.draft_service.kv_drafter import DraftSeq, KVDrafter
from treespec.draft_service.model_step import catch_up_and_expand, level_depths
from treespec.kernels.dispatch import select

if TYPE_CHECKING:
    from treespec.draft_service.config import DraftConfig


@dataclass
class _Seq(DraftSeq):
    tree_base: int = -1                               # committed length the last tree hung off
    tree_tokens: list[int] = field(default_factory=list)
    tree_parents: list[int] = field(default_factory=list)
    tree_chunk: list[int] = field(default_factory=list)  # chunk position per node, -1 none
    moves: list[tuple[int, int]] = field(default_factory=list)  # pending (src, dst) slots


class ModelProposer(KVDrafter):
    name = "model"
    levels = True
    lookahead = True            # update() rolls guessed units' KV back (draft_service/lookahead.py)

    def __init__(self, model: Qwen3Model, env: TreeEnvelope, ops: ModuleType,
                 num_blocks: int, block_size: int, model_name: str = "",
                 prefix_caching: bool = True) -> None:
        if env.topk > model.spec.vocab_size:
            raise ValueError(f"topk {env.topk} exceeds the draft vocabulary")
        self.net = model
        self.vocab_size = model.spec.vocab_size
        self.target_hidden_layers: tuple[int, ...] = ()
        self._depths = level_depths(env, model.device)
        super().__init__(model.new_cache(num_blocks, block_size, prefix_caching), env, ops,
                         model_name, [])

    @classmethod
    def load(cls, cfg: DraftConfig, device: torch.device, dtype: torch.dtype) -> ModelProposer:
        model = Qwen3Model.from_pretrained(resolve_model(cfg.model), dtype, device)
        return cls(model, cfg.envelope, select(device, cfg.kernels), cfg.num_blocks,
                   cfg.block_size, model_name=cfg.model, prefix_caching=cfg.prefix_caching)

    def _new(self) -> _Seq:
        return _Seq()

    def update(self, seq_id: int, tokens: list[int], new_count: int,
               accepted_nodes: list[int], hidden: torch.Tensor | None) -> None:
        st = self.state(seq_id)
        old = len(tokens) - new_count
        self.cache.rewind(st.pages, old)    # (guessed tokens' KV after a lookahead)
        keep = self._kept_prefix(st, tokens, old, accepted_nodes) \
            if st.tree_base == old == st.pages.kv_len else []
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

    # ------------------------------------------------------------ KVDrafter hooks
    def _units(self, st: _Seq) -> int:
        return len(st.tokens)

    def _inputs(self, st: _Seq, lo: int, hi: int) -> tuple[list[int], list[torch.Tensor]]:
        return st.tokens[lo:hi], []

    def prefix_tokens(self, st: _Seq) -> list[int]:
        return st.tokens

    def _prefill(self, rows: list[tuple[_Seq, int, int]]) -> None:
        fb = build_forward_batch([chain_chunk(st.pages, st.tokens[lo:hi]) for st, lo, hi in rows],
                                 self.cache)
        self.net(fb, self.cache, self.ops)

    def _step_fn(self, tokens: torch.Tensor, count: torch.Tensor, ctx0: torch.Tensor,
                 table: torch.Tensor, sampling: list[torch.Tensor] | None = None,
                 depth: int = 0) -> tuple[torch.Tensor, ...]:
        return catch_up_and_expand(self.net, self.cache, self.ops,
                                   shallower(self.env, depth or self.env.depth), self._depths,
                                   tokens, count, ctx0, table, sampling)

    def _before_step(self) -> None:
        """The accepted paths' KV moves owed since the last step, in one kernel."""
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

    def _drafted(self, seqs: list[_Seq], out: tuple[torch.Tensor, ...]) -> None:
        for st, tt, pp, cc in zip(seqs, *(x.tolist() for x in out[:3])):
            st.tree_base = len(st.tokens)
            st.tree_tokens, st.tree_parents, st.tree_chunk = tt, pp, cc

    def _forget(self, st: _Seq) -> None:
        st.moves, st.tree_base = [], -1
