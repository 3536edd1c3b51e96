"""Tensors across the gRPC hop: ``Tensor{dtype, shape, data}``, never repeated floats.

Device -> host goes through a reused pinned staging buffer with a non-blocking
copy (one sync per message); host -> device goes from the message bytes via
``torch.frombuffer`` into pinned memory, then a non-blocking copy.
"""

from __future__ import annotations

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


def encode(t: torch.Tensor, staging: Staging | None = None) -> pb.Tensor:
    if t.dtype not in NAMES:
        raise CodecError(f"dtype {t.dtype} cannot travel")
    host = (staging or Staging()).host_copy(t.detach())
    raw = host.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return pb.Tensor(dtype=NAMES[t.dtype], shape=list(t.shape), data=raw)


def decode(msg: pb.Tensor, device: torch.device | str = "cpu",
           expect_dtype: torch.dtype | None = None) -> torch.Tensor:
    if msg.dtype not in DTYPES:
        raise CodecError(f"unknown tensor dtype {msg.dtype!r}; expected one of {sorted(DTYPES)}")
    dtype = DTYPES[msg.dtype]
    if expect_dtype is not None and dtype != expect_dtype:
        raise CodecError(f"expected a {NAMES[expect_dtype]} tensor, got {msg.dtype}")
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape):
        raise CodecError(f"negative tensor shape {shape}")
    numel = 1
    for s in shape:
        numel *= s
    size = torch.empty((), dtype=dtype).element_size()
    if len(msg.data) != numel * size:
        raise CodecError(f"tensor of shape {shape} and dtype {msg.dtype} needs "
                         f"{numel * size} bytes, got {len(msg.data)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    host = torch.frombuffer(bytearray(msg.data), dtype=dtype).view(shape)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host
