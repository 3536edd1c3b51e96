"""`treespec demo`: both services on loopback, one prompt, speculative beside plain decode.

Starts `treespec draft` and `treespec verify` as child processes on free ports, on the
checkpoints the package ships (the tiny-code target and its tiny-code-draft; nothing
is downloaded), streams a completion, runs the same prompt again with speculation off,
and prints both timings and the acceptance figures. The children are stopped
(SIGTERM, then SIGKILL) however the demo ends.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from treespec.common.cli import positive_int
from treespec.common.client import Collector, Completion, ServerInfo, TreespecClient, tokens_per_step
from treespec.common.serving.launch import ServiceProcess, start_service
from treespec.common.model.paths import SHIPPED_DRAFTS

TARGET, DRAFT = "tiny-code", SHIPPED_DRAFTS["model"]
# Repeated spans, so an n-gram proposer has something to find too.
PROMPT = ("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n" * 2
          + "def fib(n):\n")


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _wait_draft(client: TreespecClient, timeout: float) -> ServerInfo:
    deadline = time.monotonic() + timeout
    info = client.info()
    while not info.draft_connected and time.monotonic() < deadline:
        time.sleep(0.2)
        info = client.info()
    return info


def _stream(client: TreespecClient, req: dict) -> tuple[Completion, float]:
    out = Collector()
    start = time.perf_counter()
    for chunk in client.generate_stream(**req):
        out.add(chunk)
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    elapsed = time.perf_counter() - start
    print()
    return out.result(), elapsed


def _timed(client: TreespecClient, req: dict) -> tuple[Completion, float]:
    start = time.perf_counter()
    done = client.generate(**req)
    return done, time.perf_counter() - start


def _report(spec: Completion, spec_s: float, plain: Completion, plain_s: float) -> None:
    rows = []
    for label, c, secs in (("plain decode", plain, plain_s), ("speculative", spec, spec_s)):
        s = c.stats
        n, steps = s["completion_tokens"], s["steps"]
        rows.append((label, f"{secs:.3f}", str(n), str(steps), str(s["draft_tokens"]),
                     str(s["accepted_tokens"]), f"{tokens_per_step(s):.2f}" if steps else "-",
                     f"{n / secs:.1f}" if secs else "-"))
    head = ("", "seconds", "tokens", "steps", "draft tok", "accepted", "tok/step", "tok/s")
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    for r in (head, *rows):
        print("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))))
    s = spec.stats
    if s["draft_tokens"]:
        print(f"acceptance: {s['accepted_tokens']}/{s['draft_tokens']} draft tokens "
              f"({100 * s['accepted_tokens'] / s['draft_tokens']:.0f}%), "
              f"{s['fallback_steps']} of {s['steps']} steps fell back to plain decode")
    same = spec.token_ids == plain.token_ids
    print(f"identical output with and without speculation: {'yes' if same else 'NO'}")


def add_arguments(m: argparse.ArgumentParser) -> None:
    m.add_argument("--method", choices=list(SHIPPED_DRAFTS), default="model",
                   help=f"proposer (default model: {DRAFT}; eagle3 and dflash: the shipped "
                        "tiny-code-eagle3 and tiny-code-dflash)")
    m.add_argument("--envelope", help="tree preset for the draft (default chain4; dflash: "
                                      "its block's tree)")
    m.add_argument("--device", default="auto", help="device for both services")
    m.add_argument("--max-tokens", type=positive_int, default=64)
    m.add_argument("--startup-timeout", type=float, default=180.0)


def run_demo(args: argparse.Namespace) -> int:
    method = args.method
    draft = SHIPPED_DRAFTS[method] or "none: prompt lookup"
    print(f"Using the shipped checkpoints {TARGET} (target) and {draft} (draft).")
    print(f"Proposer: {method}.")
    services: list[ServiceProcess] = []
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        draft_args = ["draft", "--method", method, "--port", "0", "--device", args.device]
        if args.envelope:
            draft_args += ["--envelope", args.envelope]
        if SHIPPED_DRAFTS[method]:
            draft_args += ["--model", SHIPPED_DRAFTS[method]]
        if method in ("eagle3", "dflash"):          # their embeddings are the target's
            draft_args += ["--target-embeddings", TARGET]
        services.append(start_service("draft", draft_args, args.startup_timeout))
        draft_addr = services[0].addr
        print(f"draft service listening on {draft_addr} (pid {services[0].proc.pid})")
        services.append(start_service("verify", [
            "verify", "--model", TARGET, "--draft", draft_addr, "--port", "0",
            "--device", args.device], args.startup_timeout))
        verify_addr = services[1].addr
        print(f"verify service listening on {verify_addr} (pid {services[1].proc.pid})",
              flush=True)
        with TreespecClient(verify_addr) as client:
            client.wait_ready(args.startup_timeout)
            info = _wait_draft(client, 30.0)
            if not info.draft_connected:
                print("warning: the verify service has not connected to the draft; "
                      "steps will run as plain decode")
            req = dict(prompt=PROMPT, max_tokens=args.max_tokens)
            client.generate(**dict(req, max_tokens=min(4, args.max_tokens)))  # warm-up
            print(f"\n--- prompt ---\n{PROMPT}--- speculative completion ---")
            spec, spec_s = _stream(client, req)
            plain, plain_s = _timed(client, dict(req, no_speculation=True))
        print()
        _report(spec, spec_s, plain, plain_s)
        print("(timings from this machine, one run each after a short warm-up)")
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"treespec demo: error: {e}", file=sys.stderr)
        for svc in services:
            if not svc.running:
                print(f"--- {svc.name} exited ({svc.proc.returncode}); its output ends with:\n"
                      f"{svc.output(40)}", file=sys.stderr)
        return 1
    finally:
        for svc in reversed(services):
            svc.stop()
        signal.signal(signal.SIGTERM, previous)
