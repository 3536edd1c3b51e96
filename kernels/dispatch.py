"""The one place that picks a kernel backend, once, when an engine is built."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Literal

import torch

from treespec.kernels.availability import triton_available

# "invariant": batch-invariant kernels (issue 53): Triton's invariant mode where Triton
# runs, else the reference (invariant on the CPU)
Backend = Literal["auto", "reference", "triton", "invariant"]

KERNEL_NAMES = ("write_kv", "paged_tree_attention", "tree_ancestors", "accept_greedy",
                "rejection_walk", "compact_kv",
                "rms_norm", "add_rms_norm", "qk_norm_rope_write", "silu_mul", "linear",
                "linear_silu_mul", "vocab_stats")


def select(device: torch.device, backend: Backend = "auto") -> ModuleType:
    """The module whose functions named in KERNEL_NAMES the engine calls."""
    if backend in ("auto", "invariant"):
        fast = "triton" if backend == "auto" else "triton_invariant"
        backend = fast if triton_available(device) else "reference"
    if backend == "reference":
        return importlib.import_module("treespec.kernels.reference")
    if backend == "triton":
        return importlib.import_module("treespec.kernels.triton_backend")
    if backend == "triton_invariant":
        return importlib.import_module("treespec.kernels.triton_invariant")
    raise ValueError(f"unknown kernel backend {backend!r}")
