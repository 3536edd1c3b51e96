"""Does the hop's Python run slower after a gap, and what in the gap makes it so?

    python bench/cold_probe.py [--out FILE] [--gap-ms 5] [--iters 300]

Inside a serving step every part of the hop costs 3-5 x what the same code costs
in a back-to-back loop, although the scheduler shows both services' threads running
the whole time (bench/sched_probe.py: no run-queue wait, no preemption). This times
one draft step's host work (decode a SpeculateRequest, DraftEngine.step with the
replay instrument, encode the Proposal, and the verify side's decode and tree
check), single threaded, right after a gap of --gap-ms spent in different ways:

  back_to_back   no gap
  sleep          time.sleep: the thread is off the CPU
  spin_python    a pure-Python loop: no system call
  spin_syscall   os.sched_yield() in a loop: a system call each turn
  spin_epoll     select.epoll().poll(0) in a loop: what a spinning event loop does
  spin_asyncio   an asyncio loop spinning with sleep(0) (common.aio.LoopSpinner's way)
  spin_cuda      a GPU matmul polled with Event.query() (the verify service's forward)

and prints the median microseconds of the work after each. It also records what the
host says of itself (clock source, CPU vulnerability mitigations, SMT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import codec, wire  # noqa: E402
from common.spec_types import SeqUpdate, SpecRequest  # noqa: E402
from common.tree import PRESETS, validate_tree  # noqa: E402
from draft_service.config import DraftConfig  # noqa: E402
from draft_service.engine import DraftEngine  # noqa: E402
from protos.treespec.v1 import treespec_pb2 as pb  # noqa: E402
from replay import ReplayProposer  # noqa: E402


class HopWork:
    """One chain-of-4 step of a 1024-token sequence, both services' host work."""

    def __init__(self) -> None:
        prompt = list(range(1024))
        self.proposer = ReplayProposer([{"prompt": prompt, "continuation": list(range(4096))}],
                                       4, 0.0, 151936, accept=3)
        self.engine = DraftEngine(DraftConfig(method="ngram", envelope=PRESETS["chain4"]),
                                  proposer=self.proposer)
        self.staging = codec.Staging()
        self.step_id = 1
        self.engine.step(SpecRequest(1, [SeqUpdate(seq_id=1, committed_len=1024,
                                                   new_tokens=prompt, full=True)]))

    def __call__(self) -> None:
        prev, self.step_id = self.step_id, self.step_id + 1
        st = self.engine._seqs[1]
        del st.tokens[1024:]                 # stay inside the reference continuation
        req = SpecRequest(self.step_id, [SeqUpdate(
            seq_id=1, committed_len=1028, new_tokens=[1, 2, 3, 4], accepted_nodes=[0, 1, 2],
            accepted_step_id=prev)])
        raw = wire.spec_request_to_pb(req, self.staging).SerializeToString()
        msg = pb.SpeculateRequest.FromString(raw)                           # draft side
        out = wire.tree_batch_to_pb(self.engine.step(wire.spec_request_from_pb(msg)),
                                    self.staging).SerializeToString()
        tree = wire.tree_batch_from_pb(pb.Proposal.FromString(out))         # verify side
        if validate_tree(tree.tokens, tree.parents, 4, 151936) is not None:
            raise RuntimeError("the probe's tree is invalid")


def gap_fn(kind: str, gap_s: float):
    if kind == "back_to_back":
        return lambda: None
    if kind == "sleep":
        return lambda: time.sleep(gap_s)

    def until(body):
        def run() -> None:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                body()
        return run

    if kind == "spin_python":
        return until(lambda: None)
    if kind == "spin_syscall":
        return until(os.sched_yield)
    if kind == "spin_epoll":
        ep = select.epoll()
        return until(lambda: ep.poll(0))
    if kind == "spin_asyncio":
        loop = asyncio.new_event_loop()

        async def spin() -> None:
            end = loop.time() + gap_s
            while loop.time() < end:
                await asyncio.sleep(0)
        return lambda: loop.run_until_complete(spin())
    if kind == "spin_cuda":
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        reps = 1
        while True:        # enough matmuls for about gap_s of GPU time
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            for _ in range(reps):
                a @ a
            ev1.record()
            ev1.synchronize()
            if ev0.elapsed_time(ev1) >= gap_s * 1000 or reps > 1000:
                break
            reps *= 2

        def run() -> None:
            for _ in range(reps):
                a @ a
            ev = torch.cuda.Event()
            ev.record()
            while not ev.query():
                pass
        return run
    raise ValueError(kind)


def host_facts() -> dict:
    def read(p: str) -> str:
        try:
            return Path(p).read_text().strip()
        except OSError:
            return ""
    vuln = Path("/sys/devices/system/cpu/vulnerabilities")
    return {"clocksource": read("/sys/devices/system/clocksource/clocksource0/"
                                "current_clocksource"),
            "smt_siblings": read("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list"),
            "mitigations": {f.name: read(str(f)) for f in sorted(vuln.iterdir())}
            if vuln.exists() else {},
            "model": next((ln.split(":", 1)[1].strip() for ln in
                           read("/proc/cpuinfo").splitlines() if ln.startswith("model name")), "")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--iters", type=int, default=300)
    a = ap.parse_args()
    work = HopWork()
    kinds = ["back_to_back", "sleep", "spin_python", "spin_syscall", "spin_epoll",
             "spin_asyncio"] + (["spin_cuda"] if torch.cuda.is_available() else [])
    res: dict = {"host": host_facts(), "gap_ms": a.gap_ms, "work_us": {}}
    for kind in kinds:
        gap = gap_fn(kind, a.gap_ms / 1000)
        times = []
        for i in range(a.iters):
            gap()
            t0 = time.perf_counter_ns()
            work()
            times.append((time.perf_counter_ns() - t0) / 1000)
        res["work_us"][kind] = round(statistics.median(times[10:]), 1)
        print(f"{kind:>13}: {res['work_us'][kind]:7.1f} us", flush=True)
    print(json.dumps(res["host"], indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
