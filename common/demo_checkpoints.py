"""The demo's models: shipped checkpoints when present, else a random pair made once.

The random pair is a tiny Qwen3 target and a draft cut from it (its first layer,
sharing embeddings and head), with a character-level tokenizer over printable ASCII,
written to `<cache>/demo-random-v1/{target,draft}`. Random weights produce gibberish;
the demo says so. They are still a real test of the machinery: speculation must
reproduce the target's greedy output exactly.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common.model_paths import SHIPPED_DIR

VERSION = "demo-random-v1"
SHIPPED_PAIR = ("tiny-code", "tiny-code-draft")
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class DemoModels:
    target: str         # checkpoint dir or shipped name, as `--model` takes it
    draft: str
    random: bool        # True: random weights made by this module


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "treespec"


def shipped_pair() -> DemoModels | None:
    if all((SHIPPED_DIR / n / "config.json").exists() for n in SHIPPED_PAIR):
        return DemoModels(target=SHIPPED_PAIR[0], draft=SHIPPED_PAIR[1], random=False)
    return None


def demo_models(cache_dir: Path | None = None) -> DemoModels:
    """The shipped pair if the package has it, else the random pair (created on first use)."""
    return shipped_pair() or random_pair(cache_dir or default_cache_dir())


def random_pair(cache_dir: Path) -> DemoModels:
    root = cache_dir / VERSION
    if not (root / "draft" / "config.json").exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{VERSION}-", dir=cache_dir))
        try:
            _write_pair(tmp)
            if root.exists():           # a half-written pair from an interrupted run
                shutil.rmtree(root)
            os.replace(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return DemoModels(target=str(root / "target"), draft=str(root / "draft"), random=True)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab[EOS_TOKEN] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS_TOKEN])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)


def _write_pair(root: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = _tokenizer()
    eos = tok.eos_token_id
    common = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=384,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=2048, tie_word_embeddings=False,
                  rms_norm_eps=1e-6, eos_token_id=eos, bos_token_id=eos)
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=4, **common))
    with torch.no_grad():  # wider than the default init, so greedy paths are not flat
        for p in target.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    draft = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=1, **common))
    draft.load_state_dict(target.state_dict(), strict=False)  # layer 0, embeddings, head
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config = GenerationConfig(eos_token_id=eos, bos_token_id=eos)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
