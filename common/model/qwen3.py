"""Qwen3 decoder over paged KV, loaded from an HF checkpoint.

One forward serves prefill (a chain chunk), decode (a one-token chunk) and tree
verify ([root, nodes] chunks): the chunk layout of kernels/reference.py carries
the difference. q/k/v and gate/up projections are fused at load time.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from treespec.common.model.checkpoint import load_state_dict, tensor_taker
from treespec.common.runtime.forward_batch import ForwardBatch
from treespec.common.runtime.kv_cache import PagedKVCache
from treespec.common.model.config import Qwen3Spec


def rope_inv_freq(spec: Qwen3Spec, device: torch.device) -> torch.Tensor:
    hd = spec.head_dim
    exps = torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd
    return (1.0 / spec.rope_theta ** exps).float()


class Qwen3Layer(nn.Module):
    def __init__(self, spec: Qwen3Spec) -> None:
        super().__init__()
        h, hd = spec.hidden_size, spec.head_dim
        self.spec = spec
        self.q_size = spec.num_heads * hd
        self.kv_size = spec.num_kv_heads * hd
        self.input_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.q_norm = nn.Parameter(torch.ones(hd))
        self.k_norm = nn.Parameter(torch.ones(hd))
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_up = nn.Linear(h, 2 * spec.intermediate_size, bias=False)
        self.down = nn.Linear(spec.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch,
                inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ops: ModuleType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (or the embeddings), residual: the stream
        before it (None at layer 0). Returns (this layer's MLP output, residual, the
        stream entering this layer: x + residual, as its first norm adds them)."""
        s, eps = self.spec, self.spec.rms_norm_eps
        h, entering = ops.add_rms_norm(x, residual, self.input_norm, eps)
        qkv = ops.linear(h, self.qkv.weight, self.qkv.bias)
        q = ops.qk_norm_rope_write(qkv, self.q_norm, self.k_norm, fb.positions, inv_freq,
                                   k_cache, v_cache, fb.slots, s.num_heads, s.num_kv_heads, eps)
        attn = ops.paged_tree_attention(q, k_cache, v_cache, fb.block_tables, fb.context_lens,
                                        fb.cu_q, fb.chunk_parents, s.head_dim ** -0.5,
                                        fb.ancestors)
        o = ops.linear(attn.reshape(x.shape[0], self.q_size), self.o_proj.weight)
        h, residual = ops.add_rms_norm(o, entering, self.post_norm, eps)
        return (ops.linear(ops.linear_silu_mul(h, self.gate_up.weight), self.down.weight),
                residual, entering)


def layer_tensors(take, src: str, dst: str, bias: bool = False) -> dict[str, torch.Tensor]:
    """One decoder layer's HF tensors (names under src, e.g. "model.layers.3.") as
    Qwen3Layer's under dst, q/k/v and gate/up fused; take(name) fetches a tensor."""
    a, m = src + "self_attn.", src + "mlp."
    own = {dst + "input_norm": take(src + "input_layernorm.weight"),
           dst + "post_norm": take(src + "post_attention_layernorm.weight"),
           dst + "qkv.weight": torch.cat([take(a + n + "_proj.weight") for n in "qkv"]),
           dst + "q_norm": take(a + "q_norm.weight"), dst + "k_norm": take(a + "k_norm.weight"),
           dst + "o_proj.weight": take(a + "o_proj.weight"),
           dst + "gate_up.weight": torch.cat([take(m + "gate_proj.weight"),
                                              take(m + "up_proj.weight")]),
           dst + "down.weight": take(m + "down_proj.weight")}
    if bias:
        own[dst + "qkv.bias"] = torch.cat([take(a + n + "_proj.bias") for n in "qkv"])
    return own


class Qwen3Model(nn.Module):
    """Embeddings, decoder layers, final norm and LM head of a Qwen3 checkpoint."""

    def __init__(self, spec: Qwen3Spec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Qwen3Layer(spec) for _ in range(spec.num_layers))
        self.norm = nn.Parameter(torch.ones(spec.hidden_size))
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(spec, self.embed.weight.device),
                             persistent=False)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "Qwen3Model":
        spec = Qwen3Spec.from_dir(path)
        with torch.device("meta"):
            model = cls(spec)
        model.load_hf_state(load_state_dict(path, dtype=dtype), dtype, torch.device(device))
        return model.eval().requires_grad_(False)

    def load_hf_state(self, sd: dict[str, torch.Tensor], dtype: torch.dtype,
                      device: torch.device) -> None:
        """Take HF Qwen3ForCausalLM tensor names, fusing qkv and gate/up."""
        take = tensor_taker(sd, "checkpoint")

        own: dict[str, torch.Tensor] = {"embed.weight": take("model.embed_tokens.weight"),
                                        "norm": take("model.norm.weight")}
        own["lm_head.weight"] = (sd["lm_head.weight"] if "lm_head.weight" in sd
                                 and not self.spec.tie_word_embeddings else own["embed.weight"])
        for i in range(self.spec.num_layers):
            own.update(layer_tensors(take, f"model.layers.{i}.", f"layers.{i}.",
                                     self.spec.attention_bias))
        own = {k: v.to(device=device, dtype=dtype) for k, v in own.items()}
        self.load_state_dict(own, strict=False, assign=True)
        self.inv_freq = rope_inv_freq(self.spec, device)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, num_blocks: int, block_size: int,
                  prefix_caching: bool = False) -> PagedKVCache:
        """prefix_caching: full pages shared by their tokens' keys, which name this
        model's shape and dtype (treespec.common.runtime.prefix_cache)."""
        s = self.spec
        return PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, num_blocks,
                            block_size, self.dtype, self.device,
                            prefix=repr(s) if prefix_caching else None)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, cache: PagedKVCache, ops: ModuleType,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-normed hidden states [T, hidden] and, for each layer index in
        capture_layers, the residual stream entering that layer [T, hidden]
        (index num_layers: the final-normed hidden states). Index i is transformers'
        ``output_hidden_states[i]``, the last one included."""
        x = self.embed(fb.input_ids)
        residual: torch.Tensor | None = None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x, residual, entering = layer(x, residual, fb, self.inv_freq, cache.k[i],
                                          cache.v[i], ops)
            if i in capture_layers:
                captured[i] = entering
        hidden, _ = ops.add_rms_norm(x, residual, self.norm, self.spec.rms_norm_eps)
        captured[self.spec.num_layers] = hidden
        return hidden, [captured[i] for i in capture_layers]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def greedy(self, hidden: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """The target's greedy choice per row, [T] int64 (argmax in the model's dtype,
        so every path that picks a token picks it the same way)."""
        return ops.linear(hidden, self.lm_head.weight).argmax(-1)
