"""TLS for both hops: a server's certificate (and, for mutual TLS, the CA its clients'
certificates must chain to), and a client's trust anchor (and certificate).

Paths are PEM files. A server with ``cert`` and ``key`` serves TLS only (a plaintext
client cannot connect); with ``client_ca`` too it requires each client to present a
certificate signed by that CA. A client with ``ca`` (or ``cert`` and ``key`` alone:
the system's roots) speaks TLS and checks the server's certificate against the
address it dials, so a certificate for 127.0.0.1 needs that IP among its subject
alternative names.

Both check their files when made (a service: before it loads its model or binds),
with the standard library's ``ssl``: a certificate file must hold a PEM certificate,
a CA file at least one, and a key must be the unencrypted PEM private key of the
certificate beside it. A refusal is a ValueError naming the flag, e.g.
``--tls-key k.pem does not match --tls-cert c.pem``.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:          # the configs hold these; engines load without grpc
    import grpc


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what} {path!r}: {e.strerror or e}") from None


def _check_certificates(path: str, flag: str) -> None:
    """ValueError unless path holds at least one PEM certificate."""
    _read(path, flag)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError:
        raise ValueError(f"{flag} {path}: holds no PEM certificate") from None


def _check_pair(cert: str, key: str, cert_flag: str, key_flag: str) -> None:
    """ValueError unless cert holds a PEM certificate and key its unencrypted private key."""
    _check_certificates(cert, cert_flag)
    if b"ENCRYPTED" in _read(key, key_flag):
        raise ValueError(f"{key_flag} {key}: an encrypted private key (gRPC reads only "
                         "unencrypted ones)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=b"")
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(f"{key_flag} {key} does not match {cert_flag} {cert}") from None
        raise ValueError(f"{key_flag} {key}: holds no PEM private key") from None


@dataclass(frozen=True)
class ServerTLS:
    cert: str | None = None          # the server's certificate chain
    key: str | None = None           # and its private key
    client_ca: str | None = None     # require client certificates signed by this CA

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.client_ca is not None and self.cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        if self.cert is not None:
            _check_pair(self.cert, self.key, "--tls-cert", "--tls-key")
        if self.client_ca is not None:
            _check_certificates(self.client_ca, "--tls-client-ca")

    @property
    def on(self) -> bool:
        return self.cert is not None

    def credentials(self) -> grpc.ServerCredentials | None:
        """None: plaintext."""
        if not self.on:
            return None
        import grpc
        ca = _read(self.client_ca, "--tls-client-ca") if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))],
            root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTLS:
    ca: str | None = None            # trust anchor for the server's certificate
    cert: str | None = None          # this client's certificate, for mutual TLS
    key: str | None = None
    flag: str = "--tls"              # how the flags are named, for errors

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError(f"{self.flag}-cert and {self.flag}-key go together")
        if self.ca is not None:
            _check_certificates(self.ca, f"{self.flag}-ca")
        if self.cert is not None and self.key is not None:
            _check_pair(self.cert, self.key, f"{self.flag}-cert", f"{self.flag}-key")

    @property
    def on(self) -> bool:
        return self.ca is not None or self.cert is not None

    def credentials(self) -> grpc.ChannelCredentials | None:
        """None: plaintext."""
        if not self.on:
            return None
        import grpc
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, f"{self.flag}-ca") if self.ca else None,
            private_key=_read(self.key, f"{self.flag}-key") if self.key else None,
            certificate_chain=_read(self.cert, f"{self.flag}-cert") if self.cert else None)


def channel(addr: str, tls: ClientTLS | None, options, aio: bool = True):
    """A channel to addr: TLS when tls is on, else plaintext."""
    import grpc
    import grpc.aio
    creds = tls.credentials() if tls is not None else None
    mod = grpc.aio if aio else grpc
    if creds is None:
        return mod.insecure_channel(addr, options=options)
    return mod.secure_channel(addr, creds, options=options)
