"""Builds tiny random HF Qwen3 checkpoints (config.json + safetensors) for tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

VOCAB = 96
EOS = 95


def make_checkpoint(path: Path, seed: int, layers: int, hidden: int, heads: int,
                    kv_heads: int, shard: bool, tie: bool, dtype=torch.float32,
                    widen: bool = True, vocab: int = VOCAB) -> Path:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=hidden // heads * 2,
                      max_position_embeddings=512, tie_word_embeddings=tie,
                      rms_norm_eps=1e-6, eos_token_id=EOS, bos_token_id=0)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    # Random init gives near-uniform logits; widen them so greedy paths are stable
    # (widen=False keeps transformers' init: near-ties, for the batch-invariance tests).
    if widen:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.3)
    model.generation_config = GenerationConfig(eos_token_id=EOS, bos_token_id=0)
    model.save_pretrained(path, max_shard_size="100KB" if shard else "1GB")
    return path
