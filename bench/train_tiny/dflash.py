"""DFlash block drafter for a Qwen3 target: the module, its exact dense forward (the
oracle of tests/test_dflash.py), training on the target's own hidden states, and
z-lab's checkpoint layout (`DFlashDraftModel`), which draft_service/dflash_head.py
serves.

Context features. ``dflash_config.target_layer_ids`` [L_1 .. L_m] name transformers'
``hidden_states[L + 1]``: the residual stream entering target layer L + 1 (=
treespec.common.model.qwen3 capture index L + 1). For the committed token at position p the feature
is f_p = concat(h_{L_1 + 1}[p], ..) [m H].

One block after committed s_0 .. s_n (features f_0 .. f_{n-1}; s_n the root, whose
features are not known yet), tokens x = [s_n, mask x (B - 1)] at positions n .. n+B-1:

    c      = rms(fc(f), hidden_norm)                                      [n, H]
    x      = embed_tokens(x)  (the target's)                              [B, H]
    layer  : h = rms(x, input_layernorm)
             q = rope(q_norm(q_proj(h)), block positions)
             k = rope(k_norm(k_proj([c; h])), [0 .. n-1; block positions]); v = v_proj([c; h])
             x = x + o_proj(softmax(q kᵀ / sqrt(d)) v)      over all n + B keys, no mask
             x = x + down(silu(gate(rms(x, post))) * up(rms(x, post)))
    logits = lm_head(rms(x, norm))  (the target's) at block positions 1 .. B-1: the
             marginals of the tokens at n + 1 .. n + B - 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from train_tiny.eagle3 import RMSNorm, _MLP
from treespec.common.model.qwen3 import rope_inv_freq
from treespec.common.model.config import Qwen3Spec
from treespec.kernels.reference import rope, rope_cos_sin


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float
                 ) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)


class _Layer(nn.Module):
    def __init__(self, s: Qwen3Spec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = _Attention(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim,
                                    s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = _MLP(s.hidden_size, s.intermediate_size)


class DFlashDrafter(nn.Module):
    """Parameters named as z-lab's checkpoints name them; embedding and LM head are
    the target's, passed to forward."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        s = self.spec = Qwen3Spec.from_dict(cfg)
        self.block_size = cfg["block_size"]
        self.mask_token_id = cfg["dflash_config"]["mask_token_id"]
        self.layer_ids = cfg["dflash_config"]["target_layer_ids"]
        self.layers = nn.ModuleList(_Layer(s) for _ in range(s.num_layers))
        self.fc = nn.Linear(len(self.layer_ids) * s.hidden_size, s.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(s, torch.device("cpu")),
                             persistent=False)

    def forward(self, feats: torch.Tensor, anchors: torch.Tensor, block: torch.Tensor,
                embed: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """feats [R, n, m H] context features of positions 0 .. n-1; anchors [R, K]: block
        k of row r sits at positions anchors[r, k] .. + S - 1 and sees the context before
        anchors[r, k] and its own S queries (training puts several blocks in one row);
        block [R, K, S] token ids; embed / lm_head [V, H] the target's -> logits
        [R, K, S - 1, V] of block positions 1 .. S - 1."""
        s = self.spec
        r, n, _ = feats.shape
        k_blocks, sl = block.shape[1:]
        q_len = k_blocks * sl
        d, hq, hkv = s.head_dim, s.num_heads, s.num_kv_heads
        dev = feats.device
        c = self.hidden_norm(self.fc(feats))                                   # [R, n, H]
        x = embed[block].view(r, q_len, -1)                                    # [R, K*S, H]
        blk_pos = (anchors.unsqueeze(-1) + torch.arange(sl, device=dev)).view(r, q_len)
        pos = torch.cat([torch.arange(n, device=dev).expand(r, n), blk_pos], 1)
        cos, sin = rope_cos_sin(pos.reshape(-1), self.inv_freq)
        own = torch.arange(k_blocks, device=dev).repeat_interleave(sl)        # query's block
        sees = torch.cat([torch.arange(n, device=dev).view(1, 1, n)
                          < blk_pos.view(r, q_len, 1) - (torch.arange(q_len, device=dev)
                                                         % sl).view(1, q_len, 1),
                          (own.view(1, q_len, 1) == own.view(1, 1, q_len)).expand(r, -1, -1)],
                         2)                                                   # [R, K*S, n+K*S]

        def rot(t: torch.Tensor, at: slice) -> torch.Tensor:                   # [R, T, h, d]
            rt, tt, hh, _ = t.shape
            cs = cos.view(r, n + q_len, -1)[:, at].reshape(rt * tt, -1)
            sn = sin.view(r, n + q_len, -1)[:, at].reshape(rt * tt, -1)
            return rope(t.reshape(rt * tt, hh, d), cs, sn).view(rt, tt, hh, d)

        for layer in self.layers:
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = rot(a.q_norm(a.q_proj(h).view(r, q_len, hq, d)), slice(n, None))
            kv_in = torch.cat([c, h], 1)
            k = rot(a.k_norm(a.k_proj(kv_in).view(r, n + q_len, hkv, d)), slice(None))
            v = a.v_proj(kv_in).view(r, n + q_len, hkv, d)
            # heads repeated (not enable_gqa), so that any CUDA kernel taking a mask may run it
            k, v = (t.repeat_interleave(hq // hkv, 2).transpose(1, 2) for t in (k, v))
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, sees[:, None])                        # [R, h, Q, d]
            x = x + a.o_proj(o.transpose(1, 2).reshape(r, q_len, hq * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = x.view(r, k_blocks, sl, -1)[:, :, 1:]      # position 0's logits are never used
        return self.norm(x) @ lm_head.T


def block_loss(model: DFlashDrafter, feats: torch.Tensor, tokens: torch.Tensor,
               embed: torch.Tensor, lm_head: torch.Tensor, blocks: int, gamma: float,
               gen: torch.Generator, low: int = 1) -> torch.Tensor:
    """Masked-block prediction on windows tokens [R, W] with the target's features
    feats [R, W, F]: `blocks` random anchors a per row (block [x_a, mask, ...], context
    f_0 .. f_{a-1}), a >= low, cross-entropy of positions 1 .. S-1 against x_{a+1} ..,
    weighted exp(-(k - 1) / gamma) toward the early positions (those every accepted
    prefix needs)."""
    r, w = tokens.shape
    sl, dev = model.block_size, tokens.device
    anchors = torch.randint(low, w - sl + 1, (r, blocks), generator=gen).to(dev)  # [R, K]
    at = anchors.unsqueeze(-1) + torch.arange(sl, device=dev)                    # [R, K, S]
    truth = tokens.gather(1, at.view(r, -1)).view(r, blocks, sl)
    block = torch.cat([truth[..., :1], torch.full_like(truth[..., 1:], model.mask_token_id)], -1)
    logits = model(feats, anchors, block, embed, lm_head)                      # [R, K, S-1, V]
    ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 2),
                                           truth[..., 1:].flatten(), reduction="none")
    weight = torch.exp(-torch.arange(sl - 1, device=dev, dtype=torch.float32) / gamma)
    return (ce.view(r, blocks, sl - 1) * weight).sum(-1).mean() / weight.sum()


@torch.no_grad()
def chain_acceptance(model: DFlashDrafter, feats: torch.Tensor, seqs: torch.Tensor,
                     prompt_len: int, embed: torch.Tensor, lm_head: torch.Tensor) -> float:
    """Tokens a greedy step commits (accepted drafts + 1) along the walk serving takes
    over seqs [N, P + G] (the target's greedy continuations): the first block after the
    prompt, each next one at the root its step reached. What bench-accept measures,
    teacher-forced. (Not the mean over every anchor: that counts each token of an easy
    stretch as an anchor of its own, while the walk crosses it in one step.)"""
    n, total = seqs.shape
    sl = model.block_size
    anchors = torch.arange(prompt_len - 1, total - sl + 1, device=seqs.device)
    rows = anchors.expand(n, -1)
    at = rows.unsqueeze(-1) + torch.arange(sl, device=seqs.device)
    truth = seqs.gather(1, at.reshape(n, -1)).view(n, len(anchors), sl)
    block = torch.cat([truth[..., :1], torch.full_like(truth[..., 1:], model.mask_token_id)], -1)
    guess = model(feats, rows, block, embed, lm_head).argmax(-1)
    return walk((guess == truth[..., 1:]).long().cumprod(-1).sum(-1) + 1)


def walk(commits: torch.Tensor) -> float:
    """Tokens a step along serving's walk, given the tokens a step would commit at each
    anchor [N, A] (anchor 0 the prompt's last token): each step moves on by its own."""
    tokens = steps = 0
    for row in commits.tolist():
        a = 0
        while a < len(row):
            tokens, steps, a = tokens + row[a], steps + 1, a + row[a]
    return tokens / steps


def drafter_config(target_cfg: dict, layers: int, block_size: int, mask_token_id: int,
                   layer_ids: list[int], intermediate: int | None = None) -> dict:
    """A DFlash config.json for a Qwen3 target's config dict (the target's attention
    shape and vocabulary, `layers` draft layers)."""
    keep = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
            "max_position_embeddings")
    cfg = {k: target_cfg[k] for k in keep if target_cfg.get(k) is not None}
    cfg.update(architectures=["DFlashDraftModel"], model_type="qwen3",
               num_hidden_layers=layers,
               intermediate_size=intermediate or target_cfg["intermediate_size"],
               num_target_layers=target_cfg["num_hidden_layers"], block_size=block_size,
               dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": layer_ids},
               tie_word_embeddings=False, attention_bias=False)
    return cfg


def save_drafter(model: DFlashDrafter, path: Path, dtype: torch.dtype) -> None:
    """config.json and model.safetensors in z-lab's layout."""
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(model.cfg, indent=2))
