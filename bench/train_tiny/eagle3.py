"""EAGLE-3 draft head for a Qwen3 target: the module, its exact forward, training-time
test (TTT), and the checkpoint layout SGLang and vLLM load (`LlamaForCausalLMEagle3`).

Notation: H hidden (= the target's), n_h / n_kv heads, d head_dim, I intermediate, V the
target vocabulary, V_d the draft vocabulary, eps = rms_norm_eps, theta = rope_theta.

Aux features. `eagle_config.eagle_aux_hidden_state_layer_ids = [a, b, c]` (ascending)
are *capture-before* indices: h_i is the residual stream entering target decoder layer i
(= transformers `output_hidden_states[i]`, = treespec.common.model.qwen3 `capture_layers` index i, = what
vLLM and SGLang's default capture; ids start at 2, so SGLang adds no +1). For the target
token at position t the feature is f_t = concat(h_a[t], h_b[t], h_c[t])  [3H].

Tensors (model.safetensors; bf16 except d2t, t2d):
    embed_tokens.weight                       [V, H]      copy of the target's embedding
                                                          (optional: without it, use the target's)
    fc.weight                                 [H, 3H]
    midlayer.input_layernorm.weight           [H]
    midlayer.hidden_norm.weight               [H]
    midlayer.self_attn.q_proj.weight          [n_h*d, 2H]
    midlayer.self_attn.k_proj.weight          [n_kv*d, 2H]
    midlayer.self_attn.v_proj.weight          [n_kv*d, 2H]
    midlayer.self_attn.o_proj.weight          [H, n_h*d]
    midlayer.post_attention_layernorm.weight  [H]
    midlayer.mlp.gate_proj.weight             [I, H]
    midlayer.mlp.up_proj.weight               [I, H]
    midlayer.mlp.down_proj.weight             [H, I]
    norm.weight                               [H]
    lm_head.weight                            [V_d, H]
    d2t  int64 [V_d]   target_id = draft_id + d2t[draft_id]
    t2d  bool  [V]     t2d[target_id]: that target token is in the draft vocabulary
All linears have no bias. rms(x, w) = x * rsqrt(mean(x^2, -1) + eps) * w, in fp32 and cast
back. rope is HF rotate-half over all d dims, inv_freq_i = theta^(-2i/d), fp32. No q/k norm.

One head step over T pairs (token x_t, input hidden u_t) at positions p_t:
    h     = fc(u)            if u is a target feature [T, 3H]; else h = u  [T, H]
    a     = concat(rms(embed_tokens(x), input_layernorm), rms(h, hidden_norm))   [T, 2H]
    q,k,v = q_proj(a), k_proj(a), v_proj(a) → heads; q, k = rope(q, p), rope(k, p)
    attn  = softmax(q·kᵀ / sqrt(d) + mask) · v, GQA (query head j uses kv head j // (n_h/n_kv))
    r     = h + o_proj(attn)                  (the residual is h, not the embedding)
    out   = r + down_proj(silu(gate_proj(rms(r, post_attention_layernorm))) * up_proj(...))
    logits_d = lm_head(rms(out, norm))        [T, V_d];  draft token = argmax + d2t[argmax]
`out` (pre-norm) is the hidden that the next step consumes.

Drafting a chain after committed tokens s_0..s_n (s_n = the bonus/root, whose target
hidden is not known yet; target features f_0..f_{n-1}):
    step 0 (extend): pairs (s_{t+1}, f_t) at positions t, t = 0..n-1, causal; the output at
            t = n-1 gives d_1 and hidden o_1.
    step k ≥ 1:      one pair (d_k, o_k) at position n-1+k; attends to every step-0 key
            (positions 0..n-1) and to the keys of steps 1..k; gives d_{k+1}, o_{k+1}.
Only step-0 keys of committed pairs stay in the head's KV cache across speculative steps.

TTT (training-time test): `unrolled` runs that chain for every root t of a window at once.
Step k at column t takes token x_{t+1+k}, hidden = step k-1's `out` at column t (step 0:
fc(f_t)), position t+k, and attends to step-0 keys at columns ≤ t plus the step-1..k keys
at column t; it is trained towards the target's distribution at position t+1+k (the
target's next-token distribution restricted to the draft vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from treespec.kernels.reference import rms_norm, rope

HEAD_TENSORS = (
    "embed_tokens.weight", "fc.weight", "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")


def aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's and SGLang's default capture-before ids [2, L//2, L-3], made strictly
    increasing inside [2, L-1] when a small L makes them collide (L=6: [2, 3, 4])."""
    if num_layers < 5:
        raise ValueError("an EAGLE-3 target needs at least 5 layers for 3 distinct aux ids")
    ids = sorted(min(max(i, 2), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))
    for k in (1, 2):
        ids[k] = max(ids[k], ids[k - 1] + 1)
    over = ids[2] - (num_layers - 1)
    if over > 0:
        ids = [i - over for i in ids]
    return ids


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = _Attention(hidden, heads, kv_heads, head_dim)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = _MLP(hidden, intermediate)


KV = tuple[torch.Tensor, torch.Tensor]  # k, v [B, n_kv, S, d], already rotated


class Eagle3Head(nn.Module):
    def __init__(self, cfg: dict) -> None:
        """cfg: the head's config.json dict (see `head_config`)."""
        super().__init__()
        self.cfg = cfg
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.heads, self.kv_heads, self.head_dim = (cfg["num_attention_heads"],
                                                    cfg["num_key_value_heads"], cfg["head_dim"])
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], h)
        self.fc = nn.Linear(3 * cfg["target_hidden_size"], h, bias=False)
        self.midlayer = _MidLayer(h, self.heads, self.kv_heads, self.head_dim,
                                  cfg["intermediate_size"], eps)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)
        self.register_buffer("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg["vocab_size"], dtype=torch.bool))
        d = self.head_dim
        inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    # -- the pieces of one step -------------------------------------------------------
    def project(self, tokens: torch.Tensor, h: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [B, T] (target ids), h [B, T, H], positions [B, T] or [T] →
        q [B, n_h, T, d], k, v [B, n_kv, T, d] (q, k rotated)."""
        m, (b, t) = self.midlayer, tokens.shape
        a = torch.cat([m.input_layernorm(self.embed_tokens(tokens)), m.hidden_norm(h)], dim=-1)
        freqs = positions.expand(b, t).reshape(-1, 1).float() * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()

        def heads(x: torch.Tensor, n: int, rotate: bool) -> torch.Tensor:
            x = x.reshape(b * t, n, self.head_dim)
            if rotate:
                x = rope(x, cos, sin)
            return x.view(b, t, n, self.head_dim).transpose(1, 2)

        return (heads(m.self_attn.q_proj(a), self.heads, True),
                heads(m.self_attn.k_proj(a), self.kv_heads, True),
                heads(m.self_attn.v_proj(a), self.kv_heads, False))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """q [B, n_h, T, d], k/v [B, n_kv, S, d], mask bool [T, S] (True = visible) →
        [B, T, n_h*d]."""
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5)
        return o.transpose(1, 2).flatten(2)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        m = self.midlayer
        r = h + m.self_attn.o_proj(attn)
        return r + m.mlp(m.post_attention_layernorm(r))

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out)).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def input_hidden(self, u: torch.Tensor) -> torch.Tensor:
        return self.fc(u) if u.shape[-1] != self.cfg["hidden_size"] else u

    # -- inference form (the reference the proposer reproduces) ----------------------
    def step(self, tokens: torch.Tensor, u: torch.Tensor, positions: torch.Tensor,
             cache: KV | None = None) -> tuple[torch.Tensor, torch.Tensor, KV]:
        """T new pairs after `cache` (all cached keys visible, causal among the new ones).
        tokens [B, T], u [B, T, 3H] target features or [B, T, H] a previous `out`,
        positions [B, T] or [T] → (out [B, T, H], draft logits [B, T, V_d] fp32, new cache)."""
        h = self.input_hidden(u)
        q, k, v = self.project(tokens, h, positions)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        t, s = q.shape[2], k.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        out = self.finish(h, self.attend(q, k, v, mask))
        return out, self.draft_logits(out), (k, v)

    @torch.no_grad()
    def draft_chain(self, tokens: torch.Tensor, feats: torch.Tensor,
                    depth: int) -> torch.Tensor:
        """Greedy chain after a committed prefix, by `step`. tokens [B, n+1] = s_0..s_n,
        feats [B, n, 3H] = f_0..f_{n-1} → draft target ids [B, depth]."""
        n = feats.shape[1]
        out, logits, cache = self.step(tokens[:, 1:], feats, torch.arange(n, device=feats.device))
        out, tok = out[:, -1:], self.to_target(logits[:, -1:].argmax(-1))
        chain = [tok]
        for k in range(1, depth):
            pos = torch.tensor([n - 1 + k], device=feats.device)
            out, logits, cache = self.step(tok, out, pos, cache)
            tok = self.to_target(logits.argmax(-1))
            chain.append(tok)
        return torch.cat(chain, dim=1)

    # -- training form ---------------------------------------------------------------
    def unrolled(self, feats: torch.Tensor, tokens: torch.Tensor, steps: int,
                 greedy: bool = False) -> list[torch.Tensor]:
        """TTT over every column at once. feats [B, T, 3H] (f_0..f_{T-1});
        tokens [B, T + steps - 1] (x_1..x_{T+steps-1}; only [:, :T] is read if greedy, the
        later steps then take the head's own argmax). Returns draft logits [B, T, V_d] per
        step; step k at column t predicts x_{t+2+k}."""
        b, t = feats.shape[:2]
        dev = feats.device
        h = self.fc(feats)
        tok = tokens[:, :t]
        ks, vs, logits = [], [], []
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        eye = torch.eye(t, dtype=torch.bool, device=dev)
        for k in range(steps):
            q, kk, vv = self.project(tok, h, torch.arange(t, device=dev) + k)
            ks.append(kk)
            vs.append(vv)
            mask = torch.cat([causal] + [eye] * k, dim=1)       # [T, (k+1)T]
            out = self.finish(h, self.attend(q, torch.cat(ks, 2), torch.cat(vs, 2), mask))
            logits.append(self.draft_logits(out))
            h = out
            if k + 1 < steps:
                tok = (self.to_target(logits[-1].argmax(-1)) if greedy
                       else tokens[:, k + 1:k + 1 + t])
        return logits


def head_config(target_cfg, intermediate: int, draft_vocab: int, aux_ids: list[int],
                dtype: str) -> dict:
    """config.json of the head: a one-layer Llama with the EAGLE-3 fields."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": target_cfg.hidden_size, "target_hidden_size": target_cfg.hidden_size,
        "intermediate_size": intermediate, "num_hidden_layers": 1,
        "num_attention_heads": target_cfg.num_attention_heads,
        "num_key_value_heads": target_cfg.num_key_value_heads,
        "head_dim": target_cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": target_cfg.rope_parameters["rope_theta"], "rope_scaling": None,
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": target_cfg.rope_parameters["rope_theta"]},
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "vocab_size": target_cfg.vocab_size, "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "norm_before_residual": False, "bos_token_id": None,
        "eos_token_id": target_cfg.eos_token_id, "pad_token_id": target_cfg.pad_token_id,
        "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids),
                         "use_aux_hidden_state": True},
    }


def new_head(cfg: dict, target, draft_ids: torch.Tensor, d2t: torch.Tensor,
             t2d: torch.Tensor, seed: int) -> Eagle3Head:
    """Random midlayer and fc (std 0.02); embed_tokens = the target's (frozen); lm_head
    starts from the target's output rows of the draft vocabulary."""
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    for mod in head.modules():
        if isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, std=0.02)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight.detach().cpu())
        out_rows = target.get_output_embeddings().weight.detach().cpu()[draft_ids]
        head.lm_head.weight.copy_(out_rows)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    head.embed_tokens.weight.requires_grad_(False)
    return head


def save_head(head: Eagle3Head, path: Path, dtype: torch.dtype) -> None:
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu())
          for k, v in head.state_dict().items()}
    assert tuple(sorted(sd)) == tuple(sorted(HEAD_TENSORS)), sorted(sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(head.cfg, indent=2) + "\n")


def load_head(path: Path, embed: torch.Tensor | None = None,
              device: torch.device | str = "cpu") -> Eagle3Head:
    """The head in fp32. `embed` [V, H] stands in when the checkpoint has no
    embed_tokens.weight (the layout's optional tensor)."""
    from treespec.common.model.checkpoint import load_state_dict
    cfg = json.loads((Path(path) / "config.json").read_text())
    sd = load_state_dict(path, dtype=torch.float32)
    if "embed_tokens.weight" not in sd:
        if embed is None:
            raise KeyError("checkpoint has no embed_tokens.weight; pass the target's embedding")
        sd["embed_tokens.weight"] = embed.float().cpu()
    head = Eagle3Head(cfg)
    head.load_state_dict(sd, strict=True)
    return head.to(device).eval().requires_grad_(False)
