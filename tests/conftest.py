"""Shared fixtures: tiny random Qwen3 checkpoints written with transformers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import make_checkpoint  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 target, sharded, untied embeddings."""
    return make_checkpoint(tmp_path_factory.mktemp("target"), seed=1, layers=2, hidden=64,
                           heads=4, kv_heads=2, shard=True, tie=False)


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory) -> Path:
    """A smaller random Qwen3 draft with the same vocabulary, tied embeddings."""
    return make_checkpoint(tmp_path_factory.mktemp("draft"), seed=2, layers=1, hidden=32,
                           heads=2, kv_heads=1, shard=False, tie=True)
