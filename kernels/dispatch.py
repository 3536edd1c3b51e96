"""The one place that picks a kernel backend, once, when an engine is built."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Literal

import torch

Backend = Literal["auto", "reference", "triton"]

KERNEL_NAMES = ("write_kv", "paged_tree_attention", "tree_ancestors", "accept_greedy",
                "rejection_walk", "compact_kv",
                "rms_norm", "add_rms_norm", "qk_norm_rope_write", "silu_mul", "linear",
                "linear_silu_mul", "vocab_stats")


def triton_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        importlib.import_module("kernels.triton_backend")
    except ImportError:
        return False
    return True


def select(device: torch.device, backend: Backend = "auto") -> ModuleType:
    """The module whose functions named in KERNEL_NAMES the engine calls."""
    if backend == "auto":
        backend = "triton" if triton_available(device) else "reference"
    if backend == "reference":
        return importlib.import_module("kernels.reference")
    if backend == "triton":
        return importlib.import_module("kernels.triton_backend")
    raise ValueError(f"unknown kernel backend {backend!r}")
