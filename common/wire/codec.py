"""Tensors across the hop: ``Tensor{dtype, shape, data}``, never repeated floats.

Only host tensors are encoded: device tensors reach the host first through a reused
pinned ``Staging`` buffer (one non-blocking copy and one sync for a whole message's
rows); decoding copies the message bytes once, into a tensor of its own. On the
same-host carrier a tensor may instead lie in the connection's shared buffer
(common/wire/shared_buffer.py): encoded as its offset there, decoded as a view of it.
"""

from __future__ import annotations

import math

import torch

from treespec.common.wire.shared_buffer import SharedBuffer
from treespec.protos.treespec.v1 import treespec_pb2 as pb

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


def encode(t: torch.Tensor, shared: SharedBuffer | None = None) -> pb.Tensor:
    """A host tensor as a message (as its offset when it lies in shared)."""
    name = NAMES.get(t.dtype)
    if name is None:
        raise CodecError(f"dtype {t.dtype} cannot travel")
    if shared is not None and (at := shared.offset_of(t)) is not None:
        return pb.Tensor(dtype=name, shape=t.shape, shared_offset=at)
    host = t.detach().contiguous()
    raw = host.view(_BYTES_VIEW.get(t.dtype, t.dtype)).numpy().tobytes() if host.numel() else b""
    return pb.Tensor(dtype=name, shape=host.shape, data=raw)


def decode(msg: pb.Tensor, expect_dtype: torch.dtype | None = None,
           shared: SharedBuffer | None = None) -> torch.Tensor:
    """A message as a host tensor (CodecError if its dtype, shape and size disagree);
    one in the connection's shared buffer is a view of it, valid until the answer."""
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise CodecError(f"unknown tensor dtype {msg.dtype!r}; expected one of {sorted(DTYPES)}")
    if expect_dtype is not None and dtype != expect_dtype:
        raise CodecError(f"expected a {NAMES[expect_dtype]} tensor, got {msg.dtype}")
    shape = tuple(msg.shape)
    if any(s < 0 for s in shape):
        raise CodecError(f"negative tensor shape {shape}")
    numel = math.prod(shape)
    if msg.HasField("shared_offset"):
        if shared is None:
            raise CodecError("a tensor in a shared buffer, on a connection without one")
        try:
            return shared.view(msg.shared_offset, dtype, shape)
        except ValueError as e:
            raise CodecError(str(e)) from e
    data = msg.data
    if len(data) != numel * dtype.itemsize:
        raise CodecError(f"tensor of shape {shape} and dtype {msg.dtype} needs "
                         f"{numel * dtype.itemsize} bytes, got {len(data)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
