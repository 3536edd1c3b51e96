"""The Qwen3 architecture numbers, read from an HF config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Qwen3Spec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def num_params(self) -> int:
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * hd * (self.num_heads * 2 + self.num_kv_heads * 2) + 2 * hd
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    @classmethod
    def from_dict(cls, cfg: dict, eos: tuple[int, ...] = ()) -> "Qwen3Spec":
        arch = cfg.get("model_type")
        if arch not in (None, "qwen3"):
            raise ValueError(f"expected a qwen3 checkpoint, config.json has model_type={arch!r}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope type {rope.get('rope_type')!r} is not supported yet")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported yet")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Qwen3Spec":
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        eos = _eos_ids(path, cfg)
        return cls.from_dict(cfg, eos)


def _eos_ids(path: Path, cfg: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json."""
    gen = path / "generation_config.json"
    src = json.loads(gen.read_text()) if gen.exists() else cfg
    eos = src.get("eos_token_id", cfg.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
