"""The OpenAI front's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from treespec.common.serving.tls import ClientTLS


@dataclass(frozen=True, kw_only=True)
class OpenAIConfig:
    verify: str                        # HOST:PORT of the verify service's Generation API
    host: str = "127.0.0.1"
    port: int = 8000                   # 0 picks a free port
    model: str | None = None           # the checkpoint whose tokenizer (and chat template)
                                       # the front uses; None: the one the verify's
                                       # GetInfo names, which must resolve on this host
    served_model_name: str | None = None   # the `model` clients send; None: the checkpoint's
    api_key_file: str | None = None    # bearer tokens HTTP clients must send, one a line
    tls_ca: str | None = None          # reach the verify over TLS, trusting this CA
    tls_cert: str | None = None        # and, for mutual TLS, with this certificate
    tls_key: str | None = None
    verify_api_key_file: str | None = None  # the bearer token for the verify (its first)
    wait_verify_s: float = 600.0       # at start, wait this long for the verify's health
    grace_s: float = 5.0               # on SIGTERM, let running responses finish this long

    @property
    def api_keys(self) -> tuple[bytes, ...] | None:
        from treespec.common.serving.auth import read_keys
        return read_keys(self.api_key_file) if self.api_key_file else None

    @property
    def verify_api_key(self) -> str | None:
        if not self.verify_api_key_file:
            return None
        from treespec.common.serving.auth import read_keys
        return read_keys(self.verify_api_key_file, "--verify-api-key-file")[0].decode()

    @property
    def verify_tls(self) -> ClientTLS:
        return ClientTLS(self.tls_ca, self.tls_cert, self.tls_key)

    def __post_init__(self) -> None:
        if ":" not in self.verify:
            raise ValueError(f"--verify wants HOST:PORT, got {self.verify!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name is empty")
        if self.wait_verify_s <= 0 or self.grace_s < 0:
            raise ValueError("--wait-verify-s must be > 0 and the grace >= 0")
        self.api_keys                  # refuses an unreadable or empty key file
        self.verify_api_key
        self.verify_tls                # and half a certificate pair
