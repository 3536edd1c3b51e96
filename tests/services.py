"""Real treespec services for tests, started through the CLI as an operator would.

    with services.stack(target_dir, "ngram") as (draft, verify):
        out = services.generate_json(verify.addr, prompt_ids=[1, 2, 3], max_tokens=8)

Services bind port 0 (or a port chosen up front, where a verify must name its draft
before the draft is up) and announce `listening on HOST:PORT`; every one started here
is stopped (SIGTERM, wait, SIGKILL) when its `with` block ends, whatever happened.
Each spends seconds importing torch: services that do not need one another started
together (`at_once`) and CLI calls made together (`run_clis`) cost about one of them
on a two-core machine.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from treespec.common.client import TreespecClient
from treespec.common.serving.launch import ServiceProcess, child_env, cli_command, start_service
from parallel_services import free_port

SERVER_MODULES = ("treespec.draft_service.server", "treespec.verify_service.server")
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


def draft_argv(method: str, *extra: str, model: Path | str | None = None,
               port: int = 0) -> list[str]:
    """`treespec draft` arguments: the method on the CPU, extra flags, the checkpoint."""
    args = ["draft", "--method", method, "--port", str(port), "--device", "cpu", *extra]
    return args + (["--model", str(model)] if model is not None else [])


def verify_argv(model: Path | str, *extra: str, draft: str | None = None) -> list[str]:
    args = ["verify", "--model", str(model), "--port", "0", "--device", "cpu", *extra]
    return args + (["--draft", draft] if draft is not None else [])


def start_draft(method: str, *extra: str, model: Path | str | None = None,
                timeout: float = STARTUP_S) -> ServiceProcess:
    return start_service(f"draft[{method}]", draft_argv(method, *extra, model=model), timeout)


def start_verify(model: Path | str, *extra: str, draft: str | None = None,
                 timeout: float = STARTUP_S) -> ServiceProcess:
    return start_service("verify", verify_argv(model, *extra, draft=draft), timeout)


@contextmanager
def at_once(*cli_args: list[str]) -> Iterator[list[ServiceProcess]]:
    """Services (`treespec <args>` each) started together, yielded once every one is
    listening; stopped last first."""
    with ExitStack() as stop:
        procs = [stop.enter_context(ServiceProcess(args[0], cli_command(*args), env=child_env()))
                 for args in cli_args]
        for p in procs:
            p.wait_listening(STARTUP_S)
        yield procs


def wait_draft_connected(verify: ServiceProcess, timeout: float = STARTUP_S, **client) -> None:
    """Until the verify service reports its draft connected (GetInfo); client: the
    TreespecClient's tls / api_key where the verify wants them."""
    deadline = time.monotonic() + timeout
    with TreespecClient(verify.addr, **client) as c:
        while not c.info().draft_connected:
            if time.monotonic() > deadline or not verify.running:
                raise RuntimeError(f"the draft never connected; verify's output ends with:\n"
                                   f"{verify.output(40)}")
            time.sleep(0.05)


@contextmanager
def stack(target: Path | str, method: str, draft_model: Path | str | None = None,
          draft_args: tuple[str, ...] = (), verify_args: tuple[str, ...] = (),
          host: str = "127.0.0.1", **client) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """A draft service and a verify service connected to it; stopped verify first.
    Both processes start together, the draft on `host` at a port chosen up front, which
    the verify retries until the draft is up; yielded once the verify reports the draft
    connected (client: as wait_draft_connected's). A test that reads what the verify
    says while its draft is unreachable starts the draft first (start_draft)."""
    port = free_port()
    bind = ("--host", host) if host != "127.0.0.1" else ()
    with at_once(draft_argv(method, *bind, *draft_args, model=draft_model, port=port),
                 verify_argv(target, *verify_args, draft=f"{host}:{port}")) as (draft, verify):
        assert draft.addr == f"{host}:{port}", draft.addr
        wait_draft_connected(verify, **client)
        yield draft, verify


def run_cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """`treespec <args>` as a subprocess, output captured."""
    return subprocess.run(cli_command(*args), capture_output=True, text=True, timeout=timeout,
                          env=child_env(), stdin=subprocess.DEVNULL)


def run_clis(*calls: list[str] | tuple[str, ...],
             timeout: float = 120.0) -> list[subprocess.CompletedProcess[str]]:
    """Several `treespec <args>` subprocesses run together; each one's result, in order."""
    procs = [subprocess.Popen(cli_command(*args), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=child_env(),
                              stdin=subprocess.DEVNULL) for args in calls]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out)
                for p, out in zip(procs, outs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def generate_args(addr: str, prompt_ids: list[int], max_tokens: int, *extra: str) -> list[str]:
    return ["generate", "--addr", addr, "--prompt-ids", ",".join(map(str, prompt_ids)),
            "--max-tokens", str(max_tokens), *extra]


def generate_json(addr: str, prompt_ids: list[int], max_tokens: int, *extra: str) -> dict:
    """`treespec generate --json` against addr; its one JSON object."""
    proc = run_cli(*generate_args(addr, prompt_ids, max_tokens, "--json", *extra))
    return parse_json(proc)


def parse_json(proc: subprocess.CompletedProcess[str]) -> dict:
    """A `treespec generate --json` call's one JSON object (it must have succeeded)."""
    assert proc.returncode == 0, f"generate failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout)
