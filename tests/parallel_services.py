"""Start several service processes at once (each spends seconds importing torch), and
stop them together. Ports are chosen up front so a verify can name its draft before
the draft is up (the verify reconnects until it is)."""

from __future__ import annotations

import random
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from treespec.common.serving.launch import ServiceProcess, child_env

STARTUP_S = 120.0


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range: a port handed
    out by bind(0) comes from that range, where any outgoing connection made before
    a service binds it (an exporter, a gRPC channel) can take it first."""
    low = max(1024, _ephemeral_low())
    for _ in range(200):
        port = random.randrange(max(1024, low // 2), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")


@contextmanager
def running(specs: list[tuple[str, list[str], dict[str, str] | None]],
            timeout: float = STARTUP_S) -> Iterator[list[ServiceProcess]]:
    """specs: (name, argv, extra env); yields the processes once all are listening."""
    procs: list[ServiceProcess] = []
    try:
        for name, argv, env in specs:
            procs.append(ServiceProcess(name, argv, env=child_env(env)))
        for p in procs:
            p.wait_listening(timeout)
        yield procs
    finally:
        for p in procs:
            if p.running:
                p.proc.send_signal(signal.SIGTERM)
        for p in procs:
            p.stop()
