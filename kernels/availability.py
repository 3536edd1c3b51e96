"""Whether the Triton kernels can run on a device: a CUDA device and an importable
Triton backend. Kept apart from dispatch so the noise reference can ask without a
cycle through the backends."""

from __future__ import annotations

import importlib

import torch


def triton_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        importlib.import_module("treespec.kernels.triton_backend")
    except ImportError:
        return False
    return True
