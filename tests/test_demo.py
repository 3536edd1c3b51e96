"""`treespec demo` runs end to end on a fresh cache, and leaves no service behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

import services
from treespec.common.serving.launch import child_env, cli_command

pytestmark = pytest.mark.skipif(services.servers_missing() is not None,
                                reason=f"{services.servers_missing()}: the demo needs both services")

PID = re.compile(r"(draft|verify) service listening on \S+ \(pid (\d+)\)")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


METHODS = ["model", "dflash"]


@pytest.fixture(scope="module")
def demos():
    """A demo run of each method, all started together (each spends seconds importing
    torch, then starts its own two services one after the other)."""
    procs = {m: subprocess.Popen(
        cli_command("demo", "--max-tokens", "24", "--device", "cpu",
                    *([] if m == "model" else ["--method", m])),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
        stdin=subprocess.DEVNULL) for m in METHODS}
    try:
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.mark.parametrize("method", METHODS)
def test_demo_runs_and_reports(method, demos):
    out, err = demos[method].communicate(timeout=300)
    assert demos[method].returncode == 0, out + err
    assert "shipped checkpoints tiny-code" in out and f"Proposer: {method}." in out
    assert f"tiny-code-{'draft' if method == 'model' else method} (draft)" in out
    assert re.search(r"^plain decode +[\d.]+ +24 +23 +0 +0 +1\.00 ", out, re.M), out
    assert re.search(r"^speculative +[\d.]+ +24 ", out, re.M), out
    assert "identical output with and without speculation: yes" in out
    pids = [int(m.group(2)) for m in PID.finditer(out)]
    assert len(pids) == 2 and wait_gone(pids)


def test_demo_stops_its_services_on_sigterm():
    demo = subprocess.Popen(cli_command("demo", "--max-tokens", "400", "--device", "cpu"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(), stdin=subprocess.DEVNULL)
    pids, lines = [], []
    try:
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append(line)
            if m := PID.search(line):
                pids.append(int(m.group(2)))
            if len(pids) == 2:
                break
        assert len(pids) == 2, "".join(lines)
        demo.send_signal(signal.SIGTERM)
        demo.wait(60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode != 0
    assert wait_gone(pids), f"services {pids} outlived the demo"
