"""Qwen3 model shapes for the benchmarks, and random-weight HF checkpoints of them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

SHAPES: dict[str, dict] = {
    # published Qwen3 configs (hidden sizes, layers, heads); vocab 151936
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=False),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True),
    # a smoke-test shape for the CPU and for shaking out the GPU path quickly
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 tie_word_embeddings=False),
}
EOS = 151645


def config(name: str) -> Qwen3Config:
    return Qwen3Config(vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                       rms_norm_eps=1e-6, eos_token_id=EOS, **SHAPES[name])


# Planted successor map (see random_hf_model): the embedding's scale against the
# layers' contributions (std 0.02 weights add O(1) per channel per layer).
PLANT_EMBED_STD = 100.0


@torch.no_grad()
def plant_successor(embed: torch.Tensor, lm_head: torch.Tensor, seed: int) -> None:
    """In place: embedding std PLANT_EMBED_STD, LM head rows = its rows permuted
    (rescaled to std 0.02); see random_hf_model."""
    embed.normal_(0, PLANT_EMBED_STD)
    g = torch.Generator().manual_seed(seed + 1)
    perm = torch.randperm(embed.shape[0], generator=g).to(embed.device)
    lm_head.copy_(embed[perm] * (0.02 / PLANT_EMBED_STD))


def random_hf_model(name: str, device: str = "cuda", seed: int = 0,
                    plant: bool = False) -> Qwen3ForCausalLM:
    """An HF Qwen3 of that shape with random bf16 weights (std 0.02), built on device.

    plant=True (untied shapes only) plants a successor map with a trained model's
    greedy margins: the embedding (std PLANT_EMBED_STD) dominates the residual
    stream, and the LM head's rows are the embedding's rows permuted, so the greedy
    next token after t is perm^-1(t) by a wide margin. Plain random weights give
    near-uniform logits whose top two lie within a bf16 step about one token in
    ten (bench/divergence.py), so any change of reduction order (a [B, 1] decode vs a
    [B, 1 + N] verify) flips argmaxes; a trained model's do not, and a benchmark
    of exact speculation needs greedy continuations that survive bf16. Shapes and
    so every timing are unchanged: only the values of two matrices differ.
    """
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config(name)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
        if plant:
            if model.config.tie_word_embeddings:
                raise ValueError(f"plant needs an untied LM head; {name} ties it")
            plant_successor(model.model.embed_tokens.weight, model.lm_head.weight, seed)
    model.generation_config = GenerationConfig(eos_token_id=EOS)
    return model.eval()


def save_checkpoint(model: Qwen3ForCausalLM, path: Path) -> float:
    """Write config.json + sharded safetensors; returns seconds taken."""
    t0 = time.perf_counter()
    model.save_pretrained(path, max_shard_size="4GB")
    return time.perf_counter() - t0


def num_params(name: str) -> int:
    c = SHAPES[name]
    h, i, hd, L = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["num_hidden_layers"]
    attn = h * hd * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"]) + 2 * hd
    emb = 151936 * h * (1 if c["tie_word_embeddings"] else 2)
    return L * (attn + 3 * h * i + 2 * h) + emb + h


if __name__ == "__main__":
    print(json.dumps({k: num_params(k) for k in SHAPES}))
