"""The EAGLE-3 draft head over paged KV, loaded from the SGLang / vLLM checkpoint layout.

The math is bench/train_tiny/eagle3.py's documented forward, step for step; only the
attention differs in form (paged, with a chunk tree mask, through the kernel backend).
One head step over T pairs (token x_t, input hidden h_t) at positions p_t:

    h      = fc(target features [T, C])   or a previous step's `out` [T, H]
    a      = concat(rms(embed(x), input_layernorm), rms(h, hidden_norm))   [T, 2H]
    q,k,v  = qkv(a); q, k = rope(q, p), rope(k, p)       (no q/k norm)
    r      = h + o_proj(attn)        (h itself; rms(h, hidden_norm) if norm_before_residual)
    out    = r + down(silu(gate(rms(r))) * up(rms(r)))
    logits = lm_head(rms(out, norm))  [T, V_d];  target id = draft id + d2t[draft id]

Checkpoint: config.json with ``draft_vocab_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids`` (the target layers whose entering
residual stream the features concatenate, in that order), tensors ``midlayer.*``,
``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d`` and optionally
``embed_tokens.weight``; without it the embedding comes from the target
(``model.embed_tokens.weight`` of a checkpoint dir or safetensors file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from safetensors import safe_open
from torch import nn

from treespec.common.model.checkpoint import CheckpointError, load_state_dict, safetensor_files, tensor_taker
from treespec.common.runtime.forward_batch import ForwardBatch
from treespec.common.runtime.kv_cache import PagedKVCache
from treespec.common.model.paths import SHIPPED_NAMES, resolve_model
from treespec.common.model.qwen3 import rope_inv_freq

TARGET_EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight")


@dataclass(frozen=True)
class Eagle3Spec:
    hidden_size: int
    feature_size: int              # C = len(aux_layer_ids) * target hidden size
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int                # the target's vocabulary (embed_tokens, t2d)
    draft_vocab_size: int          # lm_head rows (d2t)
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool = False

    @classmethod
    def from_dict(cls, cfg: dict) -> "Eagle3Spec":
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            raise ValueError("config.json lacks eagle_config.eagle_aux_hidden_state_layer_ids "
                             "(which target layers the head reads)")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError("only one-layer EAGLE-3 heads are supported")
        rope_cfg = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        kind = rope_cfg.get("rope_type", rope_cfg.get("type", "default"))
        if kind != "default":
            raise ValueError(f"rope type {kind!r} is not supported in the EAGLE-3 head")
        heads, h = cfg["num_attention_heads"], cfg["hidden_size"]
        return cls(
            hidden_size=h, feature_size=len(ids) * cfg.get("target_hidden_size", h),
            intermediate_size=cfg["intermediate_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or h // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", rope_cfg.get("rope_theta", 10000.0))),
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            aux_layer_ids=tuple(int(i) for i in ids),
            norm_before_residual=bool(cfg.get("norm_before_residual", False)))


class Eagle3Head(nn.Module):
    """One decoder layer over [embedding, hidden]; q/k/v and gate/up fused at load."""

    def __init__(self, spec: Eagle3Spec) -> None:
        super().__init__()
        s, h, d = spec, spec.hidden_size, spec.head_dim
        self.spec = s
        self.q_size, self.kv_size = s.num_heads * d, s.num_kv_heads * d
        self.embed = nn.Embedding(s.vocab_size, h)
        self.fc = nn.Linear(s.feature_size, h, bias=False)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(2 * h, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_up = nn.Linear(h, 2 * s.intermediate_size, bias=False)
        self.down = nn.Linear(s.intermediate_size, h, bias=False)
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, s.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.long))
        # draft id -> target id (arange + d2t), what to_target indexes
        self.register_buffer("target_ids", torch.arange(s.draft_vocab_size), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(s, torch.device("cpu")),
                             persistent=False)

    @classmethod
    def from_pretrained(cls, path: str | Path, target_embeddings: str | Path | None = None,
                        dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "Eagle3Head":
        """The head of checkpoint dir `path`; `target_embeddings` (see
        embedding_source) supplies embed_tokens when the checkpoint has none."""
        path = Path(path)
        spec = Eagle3Spec.from_dict(json.loads((path / "config.json").read_text()))
        src = embedding_source(path, target_embeddings)
        sd = load_state_dict(path)
        if src is not None:
            sd["embed_tokens.weight"] = load_target_embedding(src)
        with torch.device("meta"):
            head = cls(spec)
        head.load_checkpoint(sd, dtype, torch.device(device))
        return head.eval().requires_grad_(False)

    def load_checkpoint(self, sd: dict[str, torch.Tensor], dtype: torch.dtype,
                        device: torch.device) -> None:
        """Take the EAGLE-3 tensor names, fusing q/k/v and gate/up; check d2t."""
        s = self.spec

        take = tensor_taker(sd, "EAGLE-3 checkpoint")

        m, a = "midlayer.", "midlayer.self_attn."
        own = {"embed.weight": take("embed_tokens.weight"), "fc.weight": take("fc.weight"),
               "input_norm": take(m + "input_layernorm.weight"),
               "hidden_norm": take(m + "hidden_norm.weight"),
               "qkv.weight": torch.cat([take(a + n + "_proj.weight") for n in "qkv"]),
               "o_proj.weight": take(a + "o_proj.weight"),
               "post_norm": take(m + "post_attention_layernorm.weight"),
               "gate_up.weight": torch.cat([take(m + "mlp.gate_proj.weight"),
                                            take(m + "mlp.up_proj.weight")]),
               "down.weight": take(m + "mlp.down_proj.weight"),
               "norm": take("norm.weight"), "lm_head.weight": take("lm_head.weight")}
        want = {"embed.weight": (s.vocab_size, s.hidden_size),
                "fc.weight": (s.hidden_size, s.feature_size),
                "lm_head.weight": (s.draft_vocab_size, s.hidden_size)}
        for name, shape in want.items():
            if tuple(own[name].shape) != shape:
                raise CheckpointError(f"EAGLE-3 {name} has shape {tuple(own[name].shape)}, "
                                 f"config.json implies {shape}")
        own = {k: v.to(device=device, dtype=dtype) for k, v in own.items()}
        d2t = sd.get("d2t")
        if d2t is None:
            if s.draft_vocab_size != s.vocab_size:
                raise CheckpointError("EAGLE-3 checkpoint lacks d2t (needed for a reduced vocabulary)")
            d2t = torch.zeros(s.draft_vocab_size, dtype=torch.long)
        ids = torch.arange(s.draft_vocab_size) + d2t.long()
        if d2t.shape != (s.draft_vocab_size,) or ids.min() < 0 or ids.max() >= s.vocab_size:
            raise CheckpointError("EAGLE-3 d2t does not map the draft vocabulary into the target's")
        own["d2t"] = d2t.long().to(device)
        self.load_state_dict(own, strict=True, assign=True)
        self.inv_freq = rope_inv_freq(s, device)
        self.target_ids = ids.to(device)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, num_blocks: int, block_size: int, prefix: str | None = None
                  ) -> PagedKVCache:
        """prefix: the identity its pages' prefix keys name (None: no prefix caching)."""
        s = self.spec
        return PagedKVCache(1, s.num_kv_heads, s.head_dim, num_blocks, block_size,
                            self.dtype, self.device, prefix=prefix)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, cache: PagedKVCache, ops: ModuleType,
                h: torch.Tensor) -> torch.Tensor:
        """One step over fb's queries: h [T, H] (fc(features) or a previous `out`)
        -> out [T, H], the pre-norm hidden the next step consumes. Writes K/V at
        fb.slots of the cache's one layer."""
        s, eps, t = self.spec, self.spec.rms_norm_eps, h.shape[0]
        hn = ops.rms_norm(h, self.hidden_norm, eps)
        a = torch.cat([ops.rms_norm(self.embed(fb.input_ids), self.input_norm, eps), hn], -1)
        q = ops.qk_norm_rope_write(ops.linear(a, self.qkv.weight), None, None, fb.positions,
                                   self.inv_freq, cache.k[0], cache.v[0], fb.slots,
                                   s.num_heads, s.num_kv_heads, eps)
        attn = ops.paged_tree_attention(q, cache.k[0], cache.v[0], fb.block_tables,
                                        fb.context_lens, fb.cu_q, fb.chunk_parents,
                                        s.head_dim ** -0.5)
        residual = hn if s.norm_before_residual else h
        m, r = ops.add_rms_norm(ops.linear(attn.reshape(t, self.q_size), self.o_proj.weight),
                                residual, self.post_norm, eps)
        return r + ops.linear(ops.linear_silu_mul(m, self.gate_up.weight), self.down.weight)

    @torch.inference_mode()
    def logits(self, out: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """Draft-vocabulary logits [T, V_d] fp32 of `out` [T, H]."""
        return self.draft_logits(out, ops).float()

    def draft_logits(self, out: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """The same in the head's dtype (a greedy chain's argmax needs no more)."""
        return ops.linear(ops.rms_norm(out, self.norm, self.spec.rms_norm_eps),
                          self.lm_head.weight)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids (same shape and dtype)."""
        return self.target_ids[draft_ids.long()].to(draft_ids.dtype)


def _tensor_names(path: Path) -> set[str]:
    files = [path] if path.is_file() else safetensor_files(path)
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            names.update(st.keys())
    return names


def embedding_source(head_dir: Path, target_embeddings: str | Path | None) -> Path | None:
    """Where embed_tokens comes from: None when the head's checkpoint holds it, else
    `target_embeddings` (a checkpoint dir, a safetensors file or a shipped name), checked
    to hold the target's embedding. ValueError, said plainly, when neither does."""
    if "embed_tokens.weight" in _tensor_names(head_dir):
        return None
    if target_embeddings is None:
        raise ValueError(f"EAGLE-3 checkpoint {head_dir} has no embed_tokens.weight: pass "
                         "--target-embeddings PATH (the target's checkpoint dir or a "
                         "safetensors file holding model.embed_tokens.weight)")
    src = (resolve_model(str(target_embeddings)) if str(target_embeddings) in SHIPPED_NAMES
           else Path(target_embeddings).expanduser())
    if not src.exists():
        raise ValueError(f"--target-embeddings {target_embeddings}: no such file or directory")
    try:
        names = _tensor_names(src)
    except (FileNotFoundError, OSError) as e:
        raise ValueError(f"--target-embeddings {target_embeddings}: {e}") from None
    if not names & set(TARGET_EMBED_NAMES):
        raise ValueError(f"--target-embeddings {target_embeddings} holds no "
                         f"{TARGET_EMBED_NAMES[0]}")
    return src


def load_target_embedding(src: Path) -> torch.Tensor:
    """The target's input embedding [V, H] from a checkpoint dir or safetensors file."""
    for f in [src] if src.is_file() else safetensor_files(src):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in TARGET_EMBED_NAMES:
                if name in st.keys():
                    return st.get_tensor(name)
    raise KeyError(f"{src} holds no {TARGET_EMBED_NAMES[0]}")
