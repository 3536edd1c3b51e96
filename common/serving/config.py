"""What both services take: where they listen (and with which TLS), what they run on,
their KV pages.

Each service's config (``DraftConfig``, ``VerifyConfig``) extends this frozen,
keyword-only dataclass with its own fields and checks.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from treespec.common.serving.tls import ServerTLS


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
    prefix_caching: bool = True       # share full KV pages of equal prefixes (--no-prefix-caching)
    tls_cert: str | None = None       # serve TLS with this certificate chain (PEM)
    tls_key: str | None = None        # and this private key
    tls_client_ca: str | None = None  # mutual TLS: clients need a certificate of this CA
    api_key_file: str | None = None   # bearer tokens, one a line: calls need one of them
    reflection: str = "auto"          # gRPC reflection: auto = on for a loopback bind only

    @property
    def reflect(self) -> bool:
        if self.reflection != "auto":
            return self.reflection == "on"
        try:
            return self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @property
    def api_keys(self) -> tuple[bytes, ...] | None:
        from treespec.common.serving.auth import read_keys      # treespec.common.serving.auth holds grpc; engines do not
        return read_keys(self.api_key_file) if self.api_key_file else None

    @property
    def server_tls(self) -> ServerTLS:
        # an empty path is no path (compose passes --tls-cert= when TLS is off)
        return ServerTLS(self.tls_cert or None, self.tls_key or None,
                         self.tls_client_ca or None)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics port {self.metrics_port} out of range")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"--metrics-port {self.metrics_port} is --port's too")
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.server_tls                 # refuses half a pair or an unreadable file
        self.api_keys                   # and an unreadable or empty key file
        if self.reflection not in ("auto", "on", "off"):
            raise ValueError(f"--reflection wants auto, on or off, got {self.reflection!r}")
