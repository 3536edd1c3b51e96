"""What the kernel's scheduler saw of a process's threads over a timed run (Linux).

The hop of a serving step costs 3-5 x what the same Python costs in a standalone
loop (bench/NOTES.md, fifth session). A thread can be slow because it did not run
(runnable but waiting for a CPU: ``wait_ms``, from /proc/PID/task/TID/schedstat;
preempted: ``nvcsw``) or because it ran slowly (``run_ms`` as expected, the wall
longer). ``steal_ms`` is CPU time the hypervisor gave to others, over all CPUs.

    before = snapshot({"verify": pid, ...}); ...run...; delta(before, snapshot({...}))
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK_MS = 1000 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10.0


def _thread(task: Path) -> dict | None:
    try:
        run_ns, wait_ns, slices = (int(x) for x in (task / "schedstat").read_text().split())
        status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines()
                      if ":" in line)
        comm = (task / "comm").read_text().strip()
    except (OSError, ValueError):
        return None                  # the thread ended, or no schedstat on this kernel
    return {"comm": comm, "run_ms": run_ns / 1e6, "wait_ms": wait_ns / 1e6, "slices": slices,
            "vcsw": int(status["voluntary_ctxt_switches"]),
            "nvcsw": int(status["nonvoluntary_ctxt_switches"])}


def _steal_ms() -> float:
    try:
        cpu = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(cpu[8]) * _TICK_MS        # user nice system idle iowait irq softirq steal
    except (OSError, IndexError, ValueError):
        return 0.0


def snapshot(pids: dict[str, int]) -> dict:
    """{name: {tid: thread counters}} for each named process, and the host's steal."""
    procs = {}
    for name, pid in pids.items():
        tasks = Path(f"/proc/{pid}/task")
        procs[name] = {t.name: c for t in (tasks.iterdir() if tasks.exists() else [])
                       if (c := _thread(t)) is not None}
    return {"procs": procs, "steal_ms": _steal_ms()}


def delta(before: dict, after: dict, min_run_ms: float = 1.0) -> dict:
    """Per process, the threads that ran at least min_run_ms in between, busiest first."""
    out: dict = {"steal_ms": round(after["steal_ms"] - before["steal_ms"], 1)}
    for name, threads in after["procs"].items():
        rows = []
        for tid, c in threads.items():
            b = before["procs"].get(name, {}).get(tid, {})
            d = {k: round(c[k] - b.get(k, 0), 2) for k in ("run_ms", "wait_ms", "slices",
                                                            "vcsw", "nvcsw")}
            if d["run_ms"] >= min_run_ms:
                rows.append({"tid": int(tid), "comm": c["comm"], **d})
        out[name] = sorted(rows, key=lambda r: -r["run_ms"])
    return out
