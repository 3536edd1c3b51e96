"""The target and draft: transformers Qwen3 models, their losses, greedy generation, saving."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from train_tiny.settings import LMShape, Settings

SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def qwen3_config(shape: LMShape, s: Settings, eos_id: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=s.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=s.max_position, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
        tie_word_embeddings=True, attention_bias=False, use_sliding_window=False,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id)


def new_model(shape: LMShape, s: Settings, eos_id: int, seed: int,
              device: torch.device) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = qwen3_config(shape, s, eos_id)
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg).to(device)


def num_params(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def next_token_loss(model: Qwen3ForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of batch[:, 1:] given batch[:, :-1]."""
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def distill_loss(draft: Qwen3ForCausalLM, target: Qwen3ForCausalLM,
                 batch: torch.Tensor) -> torch.Tensor:
    """KL(target || draft) of next-token distributions at every position."""
    with torch.no_grad():
        logp = F.log_softmax(target(input_ids=batch).logits.float(), dim=-1)
    logq = F.log_softmax(draft(input_ids=batch).logits.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


@torch.no_grad()
def greedy_continue(model: Qwen3ForCausalLM, prompts: torch.Tensor, new_tokens: int,
                    use_cache: bool = True) -> torch.Tensor:
    """prompts [B, P] → [B, P + new_tokens], argmax decoding, EOS not special.
    use_cache=False recomputes the whole prefix each step (the reference)."""
    seq = prompts
    out = model(input_ids=seq, use_cache=use_cache, logits_to_keep=1)
    for i in range(new_tokens):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        if i + 1 == new_tokens:
            break
        if use_cache:
            with warnings.catch_warnings():  # renamed `cache` after 5.17; both accept this
                warnings.simplefilter("ignore", FutureWarning)
                out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        else:
            out = model(input_ids=seq, use_cache=False, logits_to_keep=1)
    return seq


def save_lm(model: Qwen3ForCausalLM, tok: PreTrainedTokenizerFast, path: Path,
            dtype: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    out = copy.deepcopy(model).to("cpu", SAVE_DTYPES[dtype])
    out.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                             pad_token_id=tok.eos_token_id)
    out.save_pretrained(path, safe_serialization=True)
    save_tokenizer(tok, path)


def save_tokenizer(tok: PreTrainedTokenizerFast, path: Path) -> None:
    """tokenizer.json + tokenizer_config.json, the class named PreTrainedTokenizerFast
    (transformers 5 writes its alias TokenizersBackend, which 4.x cannot resolve)."""
    tok.save_pretrained(path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def load_lm(path: Path, device: torch.device) -> Qwen3ForCausalLM:
    """A saved checkpoint, upcast to fp32 (the exact saved values), eval mode."""
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                             attn_implementation="sdpa")
    return model.to(device).eval().requires_grad_(False)
