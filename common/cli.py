"""The `treespec` command: serve the draft or verify service, generate, or run the demo.

This is the one place where service configs are built from the command line. The
service modules are imported only by the subcommand that runs them, so `treespec
generate` loads neither torch nor a model.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
import sys
from collections.abc import Sequence

from common.client import TreespecClient, TreespecError, tokens_per_step
from common.model_paths import resolve_model

SERVERS = {"draft": "draft_service.server", "verify": "verify_service.server"}


class ConfigError(ValueError):
    """A flag combination a config refused; reported on one line, exit code 2."""


def int_list(text: str) -> list[int]:
    """'1,2, 3' -> [1, 2, 3] (argparse type for id lists)."""
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _add_runtime(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, required=True, help="port to bind; 0 picks a free one")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--device", help="auto (first GPU, else CPU), cpu, cuda:1, ... (default auto)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (default auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--kernels", choices=["auto", "reference", "triton"],
                   help="kernel backend (default auto)")
    p.add_argument("--num-blocks", type=int, help="KV cache pages")
    p.add_argument("--block-size", type=int, help="tokens per KV page")
    p.add_argument("--metrics-port", type=int, metavar="P",
                   help="serve Prometheus /metrics on P (0 picks a free one; default off)")
    p.add_argument("--busy-poll", choices=["auto", "on", "off"],
                   help="while steps flow, poll on the event loop instead of sleeping "
                        "(one busy core; default auto: on when the device is CUDA)")
    p.add_argument("--rehearse", choices=["on", "off"],
                   help="while busy polling, rerun the step's host work on throwaway data "
                        "every 1 ms, so that code is warm in the CPU's caches when the "
                        "real step comes (default on)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treespec", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("draft", help="serve the Drafter service (proposes token trees)")
    d.add_argument("--method", required=True, choices=["ngram", "model", "eagle3"])
    d.add_argument("--model", help="draft checkpoint dir or shipped name (model, eagle3)")
    d.add_argument("--target-embeddings", metavar="PATH",
                   help="eagle3 head without embed_tokens: the target's checkpoint dir or a "
                   "safetensors file holding model.embed_tokens.weight")
    d.add_argument("--envelope", help="tree preset: chain4 (default), tree-small, tree-wide")
    d.add_argument("--depth", type=int, help="custom envelope: longest path, in nodes")
    d.add_argument("--topk", type=int, help="custom envelope: children per expanded node")
    d.add_argument("--nodes", type=int, help="custom envelope: nodes per tree")
    d.add_argument("--ngram-max", type=int, help="longest suffix the n-gram proposer matches")
    d.add_argument("--ngram-min", type=int, help="shortest suffix the n-gram proposer matches")
    d.add_argument("--max-sequences", type=int, help="sequences whose state the draft keeps")
    d.add_argument("--local-socket", metavar="auto|off|PATH",
                   help="also serve the per-step stream on a Unix socket, which a verify "
                        "service on this host then uses instead of gRPC (default auto: "
                        "an abstract socket on Linux; off; PATH or @name to share it across "
                        "containers through a volume)")
    _add_runtime(d)

    v = sub.add_parser("verify", help="serve the Generation service (the Qwen3 target)")
    v.add_argument("--model", required=True, help="target checkpoint dir or shipped name")
    v.add_argument("--draft", metavar="HOST:PORT", help="draft service; omit for plain decode")
    v.add_argument("--max-batch", type=int, help="running sequences per step")
    v.add_argument("--max-model-len", type=int, help="0 = the checkpoint's context")
    v.add_argument("--prefill-tokens", type=int, help="prompt tokens admitted per iteration")
    v.add_argument("--step-deadline-ms", type=float, help="wait for a proposal, then plain decode")
    v.add_argument("--reconnect-s", type=float, help="retry period while the draft is down")
    v.add_argument("--draft-socket", choices=["auto", "mailbox", "socket", "off"],
                   help="carry draft steps over the draft's local socket when it can be "
                        "reached (same host), else over the gRPC stream. auto (default): "
                        "through a shared-memory mailbox on that socket's connection while "
                        "busy polling, the socket alone otherwise; mailbox / socket: always "
                        "that; off: gRPC only")
    v.add_argument("--step-mode", choices=["auto", "ragged", "fixed"],
                   help="verify step: fixed shapes (CUDA graphs on a GPU) or ragged "
                        "(default auto: fixed on CUDA)")
    _add_runtime(v)

    g = sub.add_parser("generate", help="stream one completion from a verify service")
    g.add_argument("--addr", required=True, metavar="HOST:PORT")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (the server tokenizes it)")
    src.add_argument("--prompt-ids", type=int_list, metavar="1,2,3", help="prompt token ids")
    g.add_argument("--max-tokens", type=positive_int, required=True)
    g.add_argument("--stop-ids", type=int_list, nargs="+", default=[], metavar="IDS",
                   help="extra stop token ids, comma- or space-separated")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS ids")
    g.add_argument("--no-speculation", action="store_true", help="plain decode (for comparison)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (only mode for now)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--timeout", type=float, help="deadline for the whole call, in seconds")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object {token_ids, text, finish_reason, stats}")

    h = sub.add_parser("health", help="exit 0 when a service's gRPC health says SERVING")
    h.add_argument("--addr", required=True, metavar="HOST:PORT")
    h.add_argument("--service", default="", help="service name to check (default: the server)")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for SERVING")

    m = sub.add_parser("demo", help="start both services locally and compare with plain decode")
    m.add_argument("--method", choices=["ngram", "model"],
                   help="proposer (default: model with shipped checkpoints, else ngram)")
    m.add_argument("--envelope", default="chain4", help="tree preset for the draft")
    m.add_argument("--device", default="auto", help="device for both services")
    m.add_argument("--max-tokens", type=positive_int, default=64)
    m.add_argument("--cache-dir", help="where random demo checkpoints are kept "
                   "(default ~/.cache/treespec)")
    m.add_argument("--startup-timeout", type=float, default=180.0)

    a = sub.add_parser("bench-accept", help="acceptance of every proposer x envelope on "
                       "held-out code (greedy)")
    a.add_argument("--model", default="tiny-code", help="target (needs TRAINING.json)")
    a.add_argument("--methods", default="ngram,model,eagle3")
    a.add_argument("--envelopes", default="chain4,tree-small,tree-wide")
    a.add_argument("--files", type=positive_int, default=20, help="held-out files used")
    a.add_argument("--prompt-tokens", type=positive_int, default=128)
    a.add_argument("--max-tokens", type=positive_int, default=64)
    a.add_argument("--device", default="auto")
    a.add_argument("--json", help="also write the rows to this file")
    return parser


def bench_accept(args: argparse.Namespace) -> int:
    from common import bench_accept as ba
    print(ba.HEADER, flush=True)
    rows = ba.run(args.model, args.envelopes.split(","), args.methods.split(","), args.files,
                  args.prompt_tokens, args.max_tokens, args.device)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


def _fields(args: argparse.Namespace, names: Sequence[str]) -> dict:
    """The flags that were given, as config keyword arguments; the rest keep config defaults."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


_RUNTIME = ("host", "port", "device", "dtype", "kernels", "num_blocks", "block_size",
            "metrics_port", "busy_poll", "rehearse")


def _check_model(name: str | None) -> None:
    if name is not None:
        try:
            resolve_model(name)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None


def draft_config(args: argparse.Namespace):
    """DraftConfig from parsed `treespec draft` flags; ConfigError when it is refused."""
    from common.tree import envelope_from
    from draft_service.config import DraftConfig
    _check_model(args.model)
    try:
        env = envelope_from(args.envelope, args.depth, args.topk, args.nodes)
        cfg = DraftConfig(method=args.method, envelope=env, model=args.model,
                          **_fields(args, _RUNTIME + ("ngram_max", "ngram_min", "max_sequences",
                                                      "target_embeddings", "local_socket")))
        if cfg.method == "eagle3":
            from draft_service.eagle3_head import embedding_source
            embedding_source(resolve_model(cfg.model), cfg.target_embeddings)
        return cfg
    except ValueError as e:
        raise ConfigError(str(e)) from None


def verify_config(args: argparse.Namespace):
    """VerifyConfig from parsed `treespec verify` flags; ConfigError when it is refused."""
    from verify_service.config import VerifyConfig
    _check_model(args.model)
    try:
        return VerifyConfig(model=args.model, draft=args.draft, **_fields(
            args, _RUNTIME + ("max_batch", "max_model_len", "prefill_tokens",
                              "step_deadline_ms", "reconnect_s", "step_mode",
                              "draft_socket")))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run_server(module: str, cfg) -> None:
    """Blocks in `module.run(cfg)`, which prints `listening on HOST:PORT` once bound."""
    try:
        server = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name not in (module, module.split(".")[0]):
            raise
        raise ConfigError(f"{module} is not part of this install") from None
    server.run(cfg)


def generate(args: argparse.Namespace) -> int:
    kw = dict(prompt_ids=args.prompt_ids, max_tokens=args.max_tokens,
              stop_token_ids=[i for ids in args.stop_ids for i in ids],
              ignore_eos=args.ignore_eos, temperature=args.temperature, top_p=args.top_p,
              top_k=args.top_k, seed=args.seed, no_speculation=args.no_speculation,
              timeout=args.timeout)
    with TreespecClient(args.addr) as client:
        if args.json:
            done = client.generate(args.prompt, **kw)
            print(json.dumps({"token_ids": done.token_ids, "text": done.text,
                              "finish_reason": done.finish_reason, "stats": done.stats}))
            return 0
        as_text = client.info().has_tokenizer
        last = None
        for chunk in client.generate_stream(args.prompt, **kw):
            if as_text:
                sys.stdout.write(chunk.text)
            elif chunk.token_ids:
                sys.stdout.write("".join(f"{t} " for t in chunk.token_ids))
            sys.stdout.flush()
            last = chunk
        print()
    if last is not None and last.stats is not None:
        s = last.stats
        print(f"[{last.finish_reason}] {s['completion_tokens']} tokens in {s['steps']} steps "
              f"({tokens_per_step(s):.2f}/step), {s['accepted_tokens']}/{s['draft_tokens']} draft tokens "
              f"accepted, {s['fallback_steps']} fallback steps", file=sys.stderr)
    return 0


def health(args: argparse.Namespace) -> int:
    """0 and SERVING on stdout when healthy, else 1 and why on stderr (container health checks)."""
    with TreespecClient(args.addr) as client:
        try:
            client.wait_ready(args.timeout, args.service)
        except TimeoutError as e:
            print(f"treespec health: {e}", file=sys.stderr)
            return 1
    print("SERVING")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"treespec {args.command}"
    try:
        if args.command == "draft":
            run_server(SERVERS["draft"], draft_config(args))
        elif args.command == "verify":
            run_server(SERVERS["verify"], verify_config(args))
        elif args.command == "generate":
            return generate(args)
        elif args.command == "health":
            return health(args)
        elif args.command == "demo":
            from common.demo import run_demo
            return run_demo(args)
        elif args.command == "bench-accept":
            return bench_accept(args)
    except (ConfigError, NotImplementedError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except TreespecError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
