"""Start several service processes at once (each spends seconds importing torch), and
stop them together. Ports are chosen up front so a verify can name its draft before
the draft is up (the verify reconnects until it is)."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from common.launch import ServiceProcess, child_env

STARTUP_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
