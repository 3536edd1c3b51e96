"""A service that cannot start says why in one line naming the flag, exits 2, no traceback:
a port in use (by another program or another treespec: our gRPC servers never share a
port), an address that is not this machine's, and every kind of bad TLS material, on the
client-facing port of `treespec draft`, `treespec verify` and `treespec openai`, and on the
verify's draft hop.
Real processes through the CLI, loopback only."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

import services
from treespec.common.serving.bind import BindError, add_port
from treespec.common.serving.grpc_server import start_server
from test_tls import certs  # noqa: F401 - the module-scoped certificates fixture

TARGET = "tiny-code"
NOT_HERE = "192.0.2.1"          # TEST-NET-1: never an address of this machine
BATCH = 6                       # CLI processes at once (each imports torch)


def draft(*flags: str) -> tuple[str, ...]:
    return ("draft", "--method", "ngram", "--device", "cpu", *flags)


def verify(*flags: str) -> tuple[str, ...]:
    return ("verify", "--model", TARGET, "--device", "cpu", *flags)


def run_batched(calls: list[tuple[str, ...]]) -> list:
    """`treespec <call>` for each call, BATCH at a time; `treespec verify` refuses bad
    flags before it imports torch, so its calls go twelve at a time."""
    out, i = [], 0
    while i < len(calls):
        n = BATCH if calls[i][0] == "draft" else 2 * BATCH
        out += services.run_clis(*calls[i:i + n])
        i += n
    return out


def assert_one_line(proc, *says: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, proc.stderr
    command = proc.args[proc.args.index("treespec.common.cli") + 1]
    assert err.startswith(f"treespec {command}: error: "), err
    for s in says:
        assert s in err, (s, err)
    assert "listening on" not in proc.stdout


@pytest.fixture(scope="module")
def held_port() -> Iterator[int]:
    """A loopback port another program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def bad(certs, tmp_path_factory) -> dict[str, str]:  # noqa: F811
    """Broken TLS files: empty, garbage PEM, a key of no certificate here, an
    encrypted key."""
    d = tmp_path_factory.mktemp("bad-tls")
    key = ec.generate_private_key(ec.SECP256R1())
    files = {
        "empty": b"",
        "garbage": b"-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n",
        "text": b"this is not PEM\n",
        "stray_key": key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()),
        "encrypted_key": key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.BestAvailableEncryption(b"pw")),
    }
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
    return {name: str(d / f"{name}.pem") for name in files}


def server_tls_cases(c: dict, b: dict) -> list[tuple[tuple[str, ...], tuple[str, ...], bool]]:
    """(flags, what the error line says, whether the draft is tried too) for a
    server's --tls-* flags: every case on the verify, one of each kind on the draft."""
    cert, key, ca = c["server"]["cert"], c["server"]["key"], c["ca"]

    def tls(cert_path=cert, key_path=key, *more: str) -> tuple[str, ...]:
        return ("--tls-cert", cert_path, "--tls-key", key_path, *more)
    return [
        (tls(b["empty"]), ("--tls-cert", b["empty"], "no PEM certificate"), True),
        (tls(b["garbage"]), ("--tls-cert", "no PEM certificate"), True),
        (tls(b["text"]), ("--tls-cert", "no PEM certificate"), False),
        (tls(key, key), ("--tls-cert", "no PEM certificate"), False),     # the pair swapped
        (tls(cert, b["empty"]), ("--tls-key", b["empty"], "no PEM private key"), False),
        (tls(cert, b["garbage"]), ("--tls-key", "no PEM private key"), True),
        (tls(cert, b["stray_key"]), ("--tls-key", b["stray_key"], "does not match",
                                     "--tls-cert", cert), True),
        (tls(cert, c["client"]["key"]), ("--tls-key", "does not match"), False),
        (tls(cert, b["encrypted_key"]), ("--tls-key", "encrypted"), False),
        (tls(cert, key, "--tls-client-ca", b["garbage"]),
         ("--tls-client-ca", "no PEM certificate"), True),
        (tls(cert, key, "--tls-client-ca", b["empty"]),
         ("--tls-client-ca", "no PEM certificate"), False),
        (tls(cert, key, "--tls-client-ca", b["stray_key"]), ("--tls-client-ca",), False),
        (tls(cert, key, "--tls-client-ca", "/nonexistent/ca.pem"),
         ("--tls-client-ca", "No such file"), True),
        (("--tls-cert", cert, "--tls-client-ca", ca),
         ("--tls-cert and --tls-key go together",), False),
    ]


def draft_hop_cases(c: dict, b: dict) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(flags, what the error line says) for the verify's --draft-tls-* flags."""
    ca, cert, key = c["ca"], c["client"]["cert"], c["client"]["key"]

    def hop(ca_path=ca, cert_path=cert, key_path=key) -> tuple[str, ...]:
        return ("--draft", "127.0.0.1:1", "--draft-tls-ca", ca_path,
                "--draft-tls-cert", cert_path, "--draft-tls-key", key_path)
    return [
        (hop(b["garbage"]), ("--draft-tls-ca", "no PEM certificate")),
        (hop(b["empty"]), ("--draft-tls-ca", "no PEM certificate")),
        (hop(ca, b["text"]), ("--draft-tls-cert", "no PEM certificate")),
        (hop(ca, cert, b["garbage"]), ("--draft-tls-key", "no PEM private key")),
        (hop(ca, cert, b["stray_key"]), ("--draft-tls-key", "does not match",
                                         "--draft-tls-cert")),
        (hop(ca, cert, c["server"]["key"]), ("--draft-tls-key", "does not match")),
        (hop(ca, cert, b["encrypted_key"]), ("--draft-tls-key", "encrypted")),
    ]


def test_every_tls_misconfiguration_is_one_line_and_exit_2(certs, bad):  # noqa: F811
    """Both services check the same ServerTLS; the draft, which takes seconds to
    import torch before it refuses, is tried with one case of each kind."""
    server = server_tls_cases(certs, bad)
    hop = [(flags, says, False) for flags, says in draft_hop_cases(certs, bad)]
    calls = ([draft("--port", "0", *f) for f, _, on_draft in server if on_draft]
             + [verify("--port", "0", *f) for f, _, _ in server + hop])
    says = [s for _, s, on_draft in server if on_draft] + [s for _, s, _ in server + hop]
    for proc, words in zip(run_batched(calls), says):
        assert_one_line(proc, *words)


def test_a_port_in_use_or_an_address_not_here_is_one_line_and_exit_2(held_port):
    port = str(held_port)
    with services.start_draft("ngram", "--local-socket", "off") as running:
        taken = running.addr.rsplit(":", 1)[1]
        calls = [draft("--port", port), verify("--port", port),
                 draft("--port", taken), verify("--port", taken),
                 draft("--port", "0", "--metrics-port", port),
                 draft("--port", "0", "--host", NOT_HERE), verify("--port", "0", "--host", NOT_HERE),
                 ("openai", "--verify", "127.0.0.1:1", "--port", port)]
        procs = run_batched(calls)
        assert running.running                    # the first treespec keeps its port
    says = [(f"--port {port}: address already in use",)] * 2 + \
           [(f"--port {taken}: address already in use",)] * 2 + \
           [(f"--metrics-port {port}: address already in use",)] + \
           [(f"--host {NOT_HERE}", "not an address of this machine")] * 2 + \
           [(f"--port {port}: address already in use",)]
    for proc, words in zip(procs, says):
        assert_one_line(proc, *words)


def test_our_grpc_server_shares_its_port_with_no_other_server():
    """A second server on our port, ours or gRPC's default (which would share it by
    SO_REUSEPORT), is refused: BindError from ours, a failed bind from the other."""
    async def go():
        server, port = await start_server("127.0.0.1", 0, lambda s: None, [])
        try:
            with pytest.raises(BindError, match=f"--port {port}: address already in use"):
                await start_server("127.0.0.1", port, lambda s: None, [])
            other = grpc.aio.server()
            try:
                bound = other.add_insecure_port(f"127.0.0.1:{port}")
            except RuntimeError:                 # grpcio >= 1.85 raises
                bound = 0
            assert bound == 0
        finally:
            await server.stop(None)
    asyncio.run(go())


class _Refusing:
    """A grpc server stand-in whose bind fails as grpcio before 1.85 (0) or after (raise)."""

    def __init__(self, raises: bool) -> None:
        self.raises = raises

    def add_insecure_port(self, addr: str) -> int:
        if self.raises:
            raise RuntimeError(f"Failed to bind to address {addr}")
        return 0


@pytest.mark.parametrize("raises", [False, True])
def test_a_failed_bind_is_a_bind_error_either_way(raises):
    with pytest.raises(BindError, match=r"^--port 0: cannot bind 127\.0\.0\.1:0$"):
        add_port(_Refusing(raises), "127.0.0.1", 0, None)
