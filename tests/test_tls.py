"""TLS and mutual TLS on both hops, with certificates made here (a CA, a server
certificate for 127.0.0.1 and 127.0.0.2, a client certificate, and a second CA that
signed none of them), against services started through the CLI: a plaintext client is
refused by a TLS server, a client without a certificate by an mTLS one; draft and
verify on two addresses with mTLS on both hops serve speculative output equal to plain
decode; a verify service trusting the wrong CA serves plain decode and says why once.
The draft's local socket admits only its own user."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import services
from treespec.common.wire import frames
from treespec.common.serving.tls import ClientTLS
from treespec.draft_service import server as draft_server
from treespec.draft_service.config import DraftConfig
from treespec.common.spec.tree import envelope_from
from treespec.protos.treespec.v1 import treespec_pb2 as pb

PROMPT = [5, 17, 23, 42, 8, 17, 23, 42, 8, 17, 23]      # repeats: n-gram drafts at once


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, ca: bool = False,
          sans: list[x509.GeneralName] | None = None, usage=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(d: Path, name: str, cert: x509.Certificate, key=None) -> dict[str, str]:
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    out = {"cert": str(d / f"{name}.pem")}
    if key is not None:
        (d / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        out["key"] = str(d / f"{name}.key")
    return out


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("certs")
    keys = {n: ec.generate_private_key(ec.SECP256R1()) for n in ("ca", "other", "srv", "cli")}
    ca = _cert("treespec test CA", keys["ca"], "treespec test CA", keys["ca"], ca=True)
    other = _cert("another CA", keys["other"], "another CA", keys["other"], ca=True)
    ips = [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "127.0.0.2")]
    srv = _cert("treespec server", keys["srv"], "treespec test CA", keys["ca"],
                sans=[x509.DNSName("localhost"), *ips], usage=ExtendedKeyUsageOID.SERVER_AUTH)
    cli = _cert("treespec client", keys["cli"], "treespec test CA", keys["ca"],
                usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return {"ca": _write(d, "ca", ca)["cert"], "other_ca": _write(d, "other", other)["cert"],
            "server": _write(d, "server", srv, keys["srv"]),
            "client": _write(d, "client", cli, keys["cli"])}


def server_tls(c: dict, mutual: bool = False) -> tuple[str, ...]:
    flags = ("--tls-cert", c["server"]["cert"], "--tls-key", c["server"]["key"])
    return flags + (("--tls-client-ca", c["ca"]) if mutual else ())


def client_tls(c: dict, prefix: str = "--tls", cert: bool = True) -> tuple[str, ...]:
    flags = (f"{prefix}-ca", c["ca"])
    if cert:
        flags += (f"{prefix}-cert", c["client"]["cert"], f"{prefix}-key", c["client"]["key"])
    return flags


def healthy(proc) -> bool:
    """A `treespec health` call's answer: SERVING."""
    return proc.returncode == 0 and proc.stdout.strip() == "SERVING"


def health(addr: str, *flags: str) -> list[str]:
    return ["health", "--addr", addr, "--timeout", "2", *flags]


def test_a_tls_server_refuses_plaintext(target_dir, certs):
    with services.start_verify(target_dir, *server_tls(certs)) as tls:
        plaintext, ca_only = services.run_clis(health(tls.addr),
                                               health(tls.addr, *client_tls(certs, cert=False)))
    assert not healthy(plaintext)
    assert healthy(ca_only)


def test_two_addresses_with_mtls_on_both_hops_serve_plain_decodes_tokens(target_dir, certs):
    """The verify, mTLS, also refuses a client without a certificate."""
    with services.stack(target_dir, "ngram", host="127.0.0.2",
                        draft_args=("--local-socket", "off", *server_tls(certs, mutual=True)),
                        verify_args=("--host", "127.0.0.1", *server_tls(certs, mutual=True),
                                     *client_tls(certs, "--draft-tls")),
                        tls=ClientTLS(certs["ca"], certs["client"]["cert"],
                                      certs["client"]["key"])) as (draft, v):
        assert draft.addr.startswith("127.0.0.2:") and v.addr.startswith("127.0.0.1:")
        no_cert, with_cert = services.run_clis(health(v.addr, *client_tls(certs, cert=False)),
                                               health(v.addr, *client_tls(certs)))
        spec = services.generate_json(v.addr, PROMPT, 24, "--ignore-eos", *client_tls(certs))
        plain = services.generate_json(v.addr, PROMPT, 24, "--ignore-eos", "--no-speculation",
                                       *client_tls(certs))
    assert not healthy(no_cert) and healthy(with_cert)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["draft_tokens"] > 0, spec["stats"]        # the TLS hop carried trees


def test_a_verify_trusting_the_wrong_ca_serves_plain_decode_and_says_why_once(target_dir,
                                                                             certs):
    wrong = ("--draft-tls-ca", certs["other_ca"], "--draft-tls-cert", certs["client"]["cert"],
             "--draft-tls-key", certs["client"]["key"])
    draft = services.start_draft("ngram", "--local-socket", "off",
                                 *server_tls(certs, mutual=True))
    with draft, services.start_verify(target_dir, "--reconnect-s", "0.3", *wrong,
                                      draft=draft.addr) as v:
        up = time.monotonic()
        out = services.generate_json(v.addr, PROMPT, 8, "--ignore-eos")
        time.sleep(max(0.0, up + 2.0 - time.monotonic()))   # several reconnect attempts
        lines = [x for x in v.output().splitlines() if "unavailable" in x]
    assert out["stats"]["draft_tokens"] == 0 and len(out["token_ids"]) == 8
    assert len(lines) == 1, lines
    assert "TLS" in lines[0] and "Traceback" not in v.output()


def test_the_local_socket_admits_only_allowed_users(tmp_path):
    async def go():
        cfg = DraftConfig(method="ngram", envelope=envelope_from("chain4"), device="cpu",
                          local_socket=f"@treespec-test-{time.monotonic_ns()}")
        srv, _, _ = await draft_server.start(cfg)
        try:
            address, iid = srv.local.address, srv.servicer.instance_id
            ok = await frames.FrameStream.open(address, iid, pb.Proposal.FromString)
            ok.cancel()
            srv.local.allowed = {-1}           # as if this process ran as another user
            with pytest.raises((frames.FrameError, ConnectionError, asyncio.TimeoutError)):
                await frames.FrameStream.open(address, iid, pb.Proposal.FromString)
        finally:
            await srv.stop(0.2)

    asyncio.run(go())
