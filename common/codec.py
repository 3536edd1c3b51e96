"""Tensors across the hop: ``Tensor{dtype, shape, data}``, never repeated floats.

Only host tensors are encoded: device tensors reach the host first through a reused
pinned ``Staging`` buffer (one non-blocking copy and one sync for a whole message's
rows); decoding copies the message bytes once, into a tensor of its own.
"""

from __future__ import annotations

import math

import torch

from protos.treespec.v1 import treespec_pb2 as pb

DTYPES: dict[str, torch.dtype] = {
    "int32": torch.int32, "int64": torch.int64, "float32": torch.float32,
    "bfloat16": torch.bfloat16, "float16": torch.float16,
}
NAMES = {v: k for k, v in DTYPES.items()}


class CodecError(ValueError):
    """A Tensor message that cannot be decoded (bad dtype, shape or size)."""


class Staging:
    """A grow-only pinned host buffer reused for every device-to-host copy."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda":
            return t.contiguous()
        n = t.numel() * t.element_size()
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(max(n, 1 << 16), dtype=torch.uint8, pin_memory=True)
        host = self._buf[:n].view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        return host


# numpy has no bfloat16: its bytes travel through a same-width integer view
_BYTES_VIEW = {torch.bfloat16: torch.int16}


def encode(t: torch.Tensor) -> pb.Tensor:
    """A host tensor as a message."""
    name = NAMES.get(t.dtype)
    if name is None:
        raise CodecError(f"dtype {t.dtype} cannot travel")
    host = t.detach().contiguous()
    raw = host.view(_BYTES_VIEW.get(t.dtype, t.dtype)).numpy().tobytes() if host.numel() else b""
    return pb.Tensor(dtype=name, shape=host.shape, data=raw)


def decode(msg: pb.Tensor, expect_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A message as a host tensor (CodecError if its dtype, shape and size disagree)."""
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise CodecError(f"unknown tensor dtype {msg.dtype!r}; expected one of {sorted(DTYPES)}")
    if expect_dtype is not None and dtype != expect_dtype:
        raise CodecError(f"expected a {NAMES[expect_dtype]} tensor, got {msg.dtype}")
    shape = tuple(msg.shape)
    if any(s < 0 for s in shape):
        raise CodecError(f"negative tensor shape {shape}")
    numel = math.prod(shape)
    data = msg.data
    if len(data) != numel * dtype.itemsize:
        raise CodecError(f"tensor of shape {shape} and dtype {msg.dtype} needs "
                         f"{numel * dtype.itemsize} bytes, got {len(data)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
