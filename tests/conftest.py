"""Shared fixtures: tiny random Qwen3 checkpoints written with transformers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Before torch loads its OpenMP runtime (libgomp reads this once, at load), and inherited
# by every service and CLI process the tests start (child_env copies os.environ): idle
# OpenMP threads sleep instead of spinning. The suite runs two workers beside service
# processes on two cores; spinning threads there burn the cores the others wait for (one
# module's tests: 25 s beside a two-thread torch loop, 4.8 s with this; alone 4.5 s).
# Only how idle threads wait: no result changes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

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
