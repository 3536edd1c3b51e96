"""Run treespec services as child processes, the way an operator would.

A service started through the CLI (`python -m treespec.common.cli draft|verify ... --port 0`)
prints `listening on HOST:PORT` on stdout once it is bound; `start_service` waits for
that line and returns the address. `ServiceProcess.stop` sends SIGTERM, waits, and
kills on timeout. Used by `treespec demo` and by the tests (tests/services.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections import deque

LISTENING = re.compile(r"^listening on (\S+):(\d+)\s*$")


def cli_command(*args: str) -> list[str]:
    """argv that runs the treespec CLI with this interpreter, its working directory kept
    off sys.path (-P: from a checkout, its common/ and kernels/ folders would shadow
    installed packages, such as Hugging Face's kernels)."""
    return [sys.executable, "-P", "-m", "treespec.common.cli", *args]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment, with the child's output unbuffered."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class ServiceProcess:
    """A running service; its merged stdout/stderr is kept (last `keep` lines)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None,
                 keep: int = 400) -> None:
        self.name = name
        self.argv = argv
        self.addr: str | None = None
        self._lines: deque[str] = deque(maxlen=keep)
        self._bound = threading.Event()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env=env or child_env(), start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"{name}-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.append(line.rstrip("\n"))
            if self.addr is None and (m := LISTENING.match(line.strip())):
                self.addr = f"{m.group(1)}:{m.group(2)}"
                self._bound.set()
        self._bound.set()  # the process closed its output: wake any waiter

    def wait_listening(self, timeout: float) -> str:
        """The address from the `listening on` line; RuntimeError if none comes in time."""
        if not self._bound.wait(timeout) or self.addr is None:
            why = (f"exited with code {self.proc.poll()}" if self.proc.poll() is not None
                   else f"printed no 'listening on HOST:PORT' line within {timeout:g}s")
            raise RuntimeError(f"{self.name} {why}; its output ends with:\n{self.output(40)}")
        return self.addr

    def output(self, last: int | None = None) -> str:
        lines = list(self._lines)
        return "\n".join(lines[-last:] if last else lines)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> int:
        """SIGTERM, wait up to `grace` seconds, then SIGKILL; returns the exit code."""
        if self.running:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        return self.proc.returncode

    def __enter__(self) -> "ServiceProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_service(name: str, cli_args: list[str], timeout: float = 120.0,
                  env: dict[str, str] | None = None) -> ServiceProcess:
    """Start `treespec <cli_args>` and wait for its listening line; stops it on failure."""
    return start_process(name, cli_command(*cli_args), timeout, env)


def start_process(name: str, argv: list[str], timeout: float = 120.0,
                  env: dict[str, str] | None = None) -> ServiceProcess:
    """start_service for any argv that prints the listening line."""
    svc = ServiceProcess(name, argv, env=env)
    try:
        svc.wait_listening(timeout)
    except BaseException:
        svc.stop(grace=2.0)
        raise
    return svc
