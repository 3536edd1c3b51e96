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


# the published Qwen3-8B EAGLE-3 head's shape (one layer over the target's width)
EAGLE3 = {"qwen3-8b": dict(intermediate=12288, draft_vocab=32000, aux=[1, 17, 32]),
          "tiny": dict(intermediate=128, draft_vocab=1000, aux=[0, 1, 2])}


def random_eagle3_head(target_shape: str, path: Path, seed: int = 3) -> None:
    """An EAGLE-3 head of that target's published shape with random bf16 weights (std
    0.02), in the SGLang / vLLM layout, without embed_tokens (the draft service takes
    the target's: --target-embeddings)."""
    from safetensors.torch import save_file
    c, e = config(target_shape), EAGLE3[target_shape]
    h, hd, i, v = c.hidden_size, c.head_dim, e["intermediate"], e["draft_vocab"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    m, a = "midlayer.", "midlayer.self_attn."
    ids = torch.randperm(c.vocab_size, generator=g)[:v].sort().values
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    sd = {"fc.weight": w(h, 3 * h), "norm.weight": torch.ones(h, dtype=torch.bfloat16),
          "lm_head.weight": w(v, h), "d2t": ids - torch.arange(v), "t2d": t2d,
          m + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
          m + "hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
          m + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
          a + "q_proj.weight": w(c.num_attention_heads * hd, 2 * h),
          a + "k_proj.weight": w(c.num_key_value_heads * hd, 2 * h),
          a + "v_proj.weight": w(c.num_key_value_heads * hd, 2 * h),
          a + "o_proj.weight": w(h, c.num_attention_heads * hd),
          m + "mlp.gate_proj.weight": w(i, h), m + "mlp.up_proj.weight": w(i, h),
          m + "mlp.down_proj.weight": w(h, i)}
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": h, "target_hidden_size": h, "intermediate_size": i,
           "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": hd,
           "rms_norm_eps": c.rms_norm_eps, "rope_theta": 1e6, "vocab_size": c.vocab_size,
           "draft_vocab_size": v, "max_position_embeddings": c.max_position_embeddings,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": e["aux"],
                            "use_aux_hidden_state": True}}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


# the published Qwen3-8B DFlash drafter's shape (z-lab/Qwen3-8B-DFlash-b16): five
# Qwen3 layers of the target's width; target layers spread over 1 .. L - 3
DFLASH = {"qwen3-8b": dict(layers=5, block=16), "tiny": dict(layers=1, block=8)}


def random_dflash(target_shape: str, path: Path, device: str = "cpu", seed: int = 5) -> None:
    """A DFlash drafter of that target's published shape with random bf16 weights (std
    0.02, norms 1), in z-lab's layout (no embedding or LM head: --target-embeddings)."""
    from train_tiny.dflash import DFlashDrafter, drafter_config, save_drafter
    from treespec.draft_service.dflash_head import default_layer_ids
    c, e = config(target_shape).to_dict(), DFLASH[target_shape]
    n = c["num_hidden_layers"]
    ids = default_layer_ids(n, e["layers"]) if n > 4 else [0]
    cfg = drafter_config(c, e["layers"], e["block"], mask_token_id=c["vocab_size"] - 1,
                         layer_ids=ids)
    torch.manual_seed(seed)
    with torch.device(device):
        model = DFlashDrafter(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() == 2 else p.fill_(1.0)
    save_drafter(model, path, torch.bfloat16)


def num_params(name: str) -> int:
    c = SHAPES[name]
    h, i, hd, L = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["num_hidden_layers"]
    attn = h * hd * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"]) + 2 * hd
    emb = 151936 * h * (1 if c["tie_word_embeddings"] else 2)
    return L * (attn + 3 * h * i + 2 * h) + emb + h


if __name__ == "__main__":
    print(json.dumps({k: num_params(k) for k in SHAPES}))
