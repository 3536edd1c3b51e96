"""Real treespec services for tests, started through the CLI as an operator would.

    with services.stack(target_dir, "ngram") as (draft, verify):
        out = services.generate_json(verify.addr, prompt_ids=[1, 2, 3], max_tokens=8)

Services bind port 0 and announce `listening on HOST:PORT`; every one started here
is stopped (SIGTERM, wait, SIGKILL) when its `with` block ends, whatever happened.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from common.launch import ServiceProcess, child_env, cli_command, start_service

SERVER_MODULES = ("draft_service.server", "verify_service.server")
STARTUP_S = 120.0


def servers_missing() -> str | None:
    """Why the services cannot run yet (a server module not written), or None."""
    for module in SERVER_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"{module} does not exist yet"
    return None


def start_draft(method: str, *extra: str, model: Path | str | None = None,
                timeout: float = STARTUP_S) -> ServiceProcess:
    args = ["draft", "--method", method, "--port", "0", "--device", "cpu", *extra]
    if model is not None:
        args += ["--model", str(model)]
    return start_service(f"draft[{method}]", args, timeout)


def start_verify(model: Path | str, *extra: str, draft: str | None = None,
                 timeout: float = STARTUP_S) -> ServiceProcess:
    args = ["verify", "--model", str(model), "--port", "0", "--device", "cpu", *extra]
    if draft is not None:
        args += ["--draft", draft]
    return start_service("verify", args, timeout)


@contextmanager
def stack(target: Path | str, method: str, draft_model: Path | str | None = None,
          draft_args: tuple[str, ...] = (), verify_args: tuple[str, ...] = ()
          ) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """A draft service and a verify service connected to it; stopped verify first."""
    with ExitStack() as stop:
        draft = stop.enter_context(start_draft(method, *draft_args, model=draft_model))
        verify = stop.enter_context(start_verify(target, *verify_args, draft=draft.addr))
        yield draft, verify


def run_cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """`treespec <args>` as a subprocess, output captured."""
    return subprocess.run(cli_command(*args), capture_output=True, text=True, timeout=timeout,
                          env=child_env(), stdin=subprocess.DEVNULL)


def generate_args(addr: str, prompt_ids: list[int], max_tokens: int, *extra: str) -> list[str]:
    return ["generate", "--addr", addr, "--prompt-ids", ",".join(map(str, prompt_ids)),
            "--max-tokens", str(max_tokens), *extra]


def generate_json(addr: str, prompt_ids: list[int], max_tokens: int, *extra: str) -> dict:
    """`treespec generate --json` against addr; its one JSON object."""
    proc = run_cli(*generate_args(addr, prompt_ids, max_tokens, "--json", *extra))
    assert proc.returncode == 0, f"generate failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout)
