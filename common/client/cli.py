"""`treespec generate` and `treespec health`: the client's two subcommands."""

from __future__ import annotations

import argparse
import json
import sys

from treespec.common.cli import ConfigError, add_client_tls, int_list, positive_int
from treespec.common.client import TreespecClient, tokens_per_step
from treespec.common.serving.auth import read_keys
from treespec.common.serving.tls import ClientTLS


def client(args: argparse.Namespace) -> TreespecClient:
    try:
        # an empty path is no path (compose's health checks pass --tls-ca= when TLS is off)
        tls = ClientTLS(args.tls_ca or None, args.tls_cert or None, args.tls_key or None)
        key = read_keys(args.api_key_file)[0] if args.api_key_file else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return TreespecClient(args.addr, tls=tls, api_key=key.decode() if key else None)


def add_generate_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--addr", required=True, metavar="HOST:PORT")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (the server tokenizes it)")
    src.add_argument("--prompt-ids", type=int_list, metavar="1,2,3", help="prompt token ids")
    g.add_argument("--max-tokens", type=positive_int, required=True)
    g.add_argument("--stop-ids", type=int_list, nargs="+", default=[], metavar="IDS",
                   help="extra stop token ids, comma- or space-separated")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS ids")
    g.add_argument("--no-speculation", action="store_true", help="plain decode (for comparison)")
    g.add_argument("--temperature", type=float,
                   help="0 = greedy (default: the server's, from its checkpoint)")
    g.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (0 = all)")
    g.add_argument("--top-p", type=float, help="... among the likeliest with this mass")
    g.add_argument("--min-p", type=float, help="... at least this share of the likeliest's")
    g.add_argument("--seed", type=int, help="the same seed and request: the same tokens")
    g.add_argument("--timeout", type=float, help="deadline for the whole call, in seconds")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object {token_ids, text, finish_reason, stats}")
    add_client_tls(g)


def generate(args: argparse.Namespace) -> int:
    kw = dict(prompt_ids=args.prompt_ids, max_tokens=args.max_tokens,
              stop_token_ids=[i for ids in args.stop_ids for i in ids],
              ignore_eos=args.ignore_eos, temperature=args.temperature, top_p=args.top_p,
              top_k=args.top_k, min_p=args.min_p, seed=args.seed,
              no_speculation=args.no_speculation,
              timeout=args.timeout)
    with client(args) as c:
        if args.json:
            done = c.generate(args.prompt, **kw)
            print(json.dumps({"token_ids": done.token_ids, "text": done.text,
                              "finish_reason": done.finish_reason, "stats": done.stats}))
            return 0
        as_text = c.info().has_tokenizer
        last = None
        for chunk in c.generate_stream(args.prompt, **kw):
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


def add_health_arguments(h: argparse.ArgumentParser) -> None:
    h.add_argument("--addr", required=True, metavar="HOST:PORT")
    h.add_argument("--service", default="", help="service name to check (default: the server)")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for SERVING")
    add_client_tls(h)


def health(args: argparse.Namespace) -> int:
    """0 and SERVING on stdout when healthy, else 1 and why on stderr (container health checks)."""
    with client(args) as c:
        try:
            c.wait_ready(args.timeout, args.service)
        except TimeoutError as e:
            print(f"treespec health: {e}", file=sys.stderr)
            return 1
    print("SERVING")
    return 0
