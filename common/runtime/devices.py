"""Device and dtype choice from config strings, in one place."""

from __future__ import annotations

import torch


def pick_device(name: str) -> torch.device:
    """'auto' = the first visible GPU, else the CPU; otherwise a torch device string."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but no CUDA device is visible")
    if dev.type == "cuda" and dev.index is None:
        # 'cuda' means the current device; name it, so set_device and graphs can use it
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def bind_device(dev: torch.device) -> None:
    """Make dev the current CUDA device, so streams, graphs and pinned staging made
    without an explicit device land on it (no-op on the CPU)."""
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' = bfloat16 on a GPU, float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; expected auto or one of {sorted(table)}")
    return table[name]
