"""What both services take: where they listen, what they run on, their KV pages.

Each service's config (``DraftConfig``, ``VerifyConfig``) extends this frozen,
keyword-only dataclass with its own fields and checks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 0                     # 0 picks a free port
    metrics_port: int | None = None   # /metrics: None = off, 0 = a free port
    device: str = "auto"
    dtype: str = "auto"
    kernels: str = "auto"             # auto | reference | triton
    num_blocks: int = 2048            # KV pages (each service sets its own default)
    block_size: int = 16              # tokens per KV page
    busy_poll: str = "auto"           # auto (on when the device is CUDA), on, off
    rehearse: str = "on"              # while busy polling, keep the step's host code warm

    def busy(self, device_type: str) -> bool:
        """Whether the service polls on its event loop instead of sleeping."""
        return self.busy_poll == "on" or (self.busy_poll == "auto" and device_type == "cuda")

    def rehearsing(self, device_type: str) -> bool:
        """Whether the busy loop rehearses the step's host work (common.aio.LoopSpinner)."""
        return self.busy(device_type) and self.rehearse == "on"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics port {self.metrics_port} out of range")
        if self.busy_poll not in ("auto", "on", "off"):
            raise ValueError(f"busy_poll must be auto, on or off, got {self.busy_poll!r}")
        if self.rehearse not in ("on", "off"):
            raise ValueError(f"rehearse must be on or off, got {self.rehearse!r}")
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
