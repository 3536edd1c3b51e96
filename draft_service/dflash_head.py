"""The DFlash block-diffusion drafter over paged KV, loaded from z-lab's checkpoint layout.

A DFlash drafter is a few Qwen3 decoder layers with no embedding or LM head of its
own (both are the target's). Its context is the target's hidden states: for each
committed token at position p the states of the target layers ``target_layer_ids``
are concatenated and projected, c_p = hidden_norm(fc(f_p)), and every draft layer
keeps k_p = rope(k_norm(k_proj(c_p)), p), v_p = v_proj(c_p) in its KV cache (c is
not layer-normed). A step drafts a block of B positions from the root r, the last
committed token, at position n:

    x      = embed([r, mask, ..., mask])                    positions n .. n + B - 1
    layers = Qwen3 decoder layers whose queries are the block's and whose keys and
             values are the context's [0, n) and the block's own, all visible
             (non-causal inside the block: chunk parents BLOCK)
    logits = lm_head(norm(x)) at block positions 1 .. B - 1: the marginals of the
             tokens at n + 1 .. n + B - 1

Checkpoint: config.json with ``block_size``, ``num_target_layers``,
``dflash_config.mask_token_id``, optionally ``dflash_config.target_layer_ids``
(default: spread evenly over 1 .. num_target_layers - 3) and the Qwen3 fields;
tensors ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.{input,post_attention}_layernorm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``hidden_norm.weight``,
``fc.weight``.

Target layer ids are z-lab's: id i (0 .. num_target_layers - 1) is the output of target
layer i, transformers' ``output_hidden_states[i + 1]``. The verify service captures
the residual stream *entering* a layer, so the ids become capture indices i + 1 here,
once (``DFlashSpec.capture_layers``); the last layer's id becomes num_target_layers,
which the target answers with its final-normed hidden states, as transformers does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from treespec.common.model.checkpoint import CheckpointError, load_state_dict, tensor_taker
from treespec.common.runtime.forward_batch import ForwardBatch
from treespec.common.runtime.kv_cache import PagedKVCache
from treespec.common.model.config import Qwen3Spec
from treespec.common.model.paths import resolve_model
from treespec.common.model.qwen3 import Qwen3Layer, layer_tensors, rope_inv_freq


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: one layer in the middle, else spread from 1 to L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1)))
            for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashSpec:
    layers: Qwen3Spec              # the draft layers (vocab_size: the target's)
    block_size: int                # B: the root and B - 1 drafted positions
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target capture indices of the layer ids: id i -> i + 1."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @classmethod
    def from_dict(cls, cfg: dict) -> DFlashSpec:
        def need(what: str, value):
            if value is None:
                raise ValueError(f"DFlash config.json lacks {what}")
            return value
        arch = cfg.get("architectures") or ["DFlashDraftModel"]
        if "DFlashDraftModel" not in arch:
            raise ValueError(f"config.json architectures {arch} is not a DFlashDraftModel")
        extra = cfg.get("dflash_config") or {}
        layers = Qwen3Spec.from_dict(cfg)
        n_target = int(need("num_target_layers", cfg.get("num_target_layers")))
        ids = extra.get("target_layer_ids") or default_layer_ids(n_target, layers.num_layers)
        bad = [i for i in ids if not 0 <= int(i) < n_target]
        if bad:
            raise ValueError(f"DFlash target_layer_ids {bad} outside 0 .. {n_target - 1} "
                             f"(num_target_layers {n_target})")
        block = int(need("block_size", cfg.get("block_size")))
        if block < 2:
            raise ValueError(f"DFlash block_size {block}: needs at least 2")
        mask = int(need("dflash_config.mask_token_id", extra.get("mask_token_id")))
        if not 0 <= mask < layers.vocab_size:
            raise ValueError(f"DFlash mask_token_id {mask} outside the vocabulary "
                             f"({layers.vocab_size})")
        return cls(layers, block, mask, tuple(int(i) for i in ids), n_target)


class DFlashHead(nn.Module):
    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__()
        s, h = spec.layers, spec.layers.hidden_size
        self.spec = spec
        self.embed = nn.Embedding(s.vocab_size, h)
        self.layers = nn.ModuleList(Qwen3Layer(s) for _ in range(s.num_layers))
        self.fc = nn.Linear(len(spec.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, s.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(s, torch.device("cpu")),
                             persistent=False)

    @classmethod
    def from_pretrained(cls, path: str | Path, target: str | Path | None,
                        dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> DFlashHead:
        """The drafter of checkpoint dir `path`, with the embedding and LM head of the
        target checkpoint `target` (a dir or a shipped name)."""
        spec, src = checked_source(path, target)
        sd = load_state_dict(path)
        sd.update(_target_io(src))
        with torch.device("meta"):
            head = cls(spec)
        head.load_checkpoint(sd, dtype, torch.device(device))
        return head.eval().requires_grad_(False)

    def load_checkpoint(self, sd: dict[str, torch.Tensor], dtype: torch.dtype,
                        device: torch.device) -> None:
        """Take the DFlash tensor names, fusing q/k/v and gate/up; check shapes."""
        take = tensor_taker(sd, "DFlash checkpoint")
        own = {"embed.weight": take("embed_tokens.weight"), "lm_head.weight": take("lm_head"),
               "fc.weight": take("fc.weight"), "hidden_norm": take("hidden_norm.weight"),
               "norm": take("norm.weight")}
        for i in range(self.spec.layers.num_layers):
            own.update(layer_tensors(take, f"layers.{i}.", f"layers.{i}."))
        want = {k: tuple(v.shape) for k, v in self.state_dict().items()}
        for name, t in own.items():
            if tuple(t.shape) != want[name]:
                raise CheckpointError(f"DFlash {name} has shape {tuple(t.shape)}, config.json "
                                 f"implies {want[name]}")
        own = {k: v.to(device=device, dtype=dtype) for k, v in own.items()}
        self.load_state_dict(own, strict=True, assign=True)
        self.inv_freq = rope_inv_freq(self.spec.layers, device)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, num_blocks: int, block_size: int, prefix: str | None = None
                  ) -> PagedKVCache:
        """prefix: the identity its pages' prefix keys name (None: no prefix caching)."""
        s = self.spec.layers
        return PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, num_blocks, block_size,
                            self.dtype, self.device, prefix=prefix)

    @torch.inference_mode()
    def write_context(self, feats: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      cache: PagedKVCache, ops: ModuleType) -> None:
        """The context K/V of projected target features feats [T, H] (fc's output) at
        positions [T], into every layer's slots [T]."""
        s = self.spec.layers
        c = ops.rms_norm(feats, self.hidden_norm, s.rms_norm_eps)
        for i, layer in enumerate(self.layers):
            qkv = ops.linear(c, layer.qkv.weight, layer.qkv.bias)
            ops.qk_norm_rope_write(qkv, layer.q_norm, layer.k_norm, positions, self.inv_freq,
                                   cache.k[i], cache.v[i], slots, s.num_heads, s.num_kv_heads,
                                   s.rms_norm_eps)

    @torch.inference_mode()
    def block(self, fb: ForwardBatch, cache: PagedKVCache, ops: ModuleType) -> torch.Tensor:
        """The block queries of fb (chunk parents BLOCK) -> final-normed hidden [T, H]."""
        x, residual = self.embed(fb.input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual, _ = layer(x, residual, fb, self.inv_freq, cache.k[i], cache.v[i], ops)
        hidden, _ = ops.add_rms_norm(x, residual, self.norm, self.spec.layers.rms_norm_eps)
        return hidden

    def logits(self, hidden: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        return ops.linear(hidden, self.lm_head.weight).float()


def checked_source(path: str | Path, target: str | Path | None) -> tuple[DFlashSpec, Path]:
    """The checkpoint's spec and the target dir its embedding and LM head come from
    (ValueError naming what is wrong)."""
    try:
        spec = DFlashSpec.from_dict(json.loads((Path(path) / "config.json").read_text()))
    except KeyError as e:
        raise ValueError(f"DFlash config.json lacks {e}") from None
    if target is None:
        raise ValueError("a DFlash drafter has no embedding or LM head of its own: pass "
                         "--target-embeddings with the target's checkpoint dir")
    try:
        return spec, resolve_model(str(target))
    except FileNotFoundError as e:
        raise ValueError(f"--target-embeddings: {e}") from None


def _target_io(src: Path) -> dict[str, torch.Tensor]:
    """The target's embedding and LM head (tied: the embedding) from checkpoint dir src."""
    cfg = json.loads((src / "config.json").read_text())
    sd = load_state_dict(src, names={"model.embed_tokens.weight", "lm_head.weight"})
    embed = sd.get("model.embed_tokens.weight")
    if embed is None:
        raise ValueError(f"--target-embeddings {src} holds no model.embed_tokens.weight")
    head = embed if cfg.get("tie_word_embeddings") else sd.get("lm_head.weight")
    if head is None:
        raise ValueError(f"--target-embeddings {src} holds no lm_head.weight")
    return {"embed_tokens.weight": embed, "lm_head": head}
