"""`treespec openai`: its flags, the OpenAIConfig they make, and serving it."""

from __future__ import annotations

import argparse

from treespec.common.cli import ConfigError, add_client_tls, check_model, given

FLAGS = ("host", "port", "model", "served_model_name", "api_key_file", "tls_ca", "tls_cert",
         "tls_key", "verify_api_key_file", "wait_verify_s", "grace_s")


def _or_none(text: str) -> str | None:
    """An empty value is no value (compose passes --flag= for what is unset)."""
    return text or None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify", required=True, metavar="HOST:PORT",
                   help="the verify service's Generation API")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind; 0 picks a free one (default 8000)")
    p.add_argument("--model", type=_or_none,
                   help="checkpoint dir or shipped name whose tokenizer and chat template "
                        "to use: the verify's (default: the one the verify's GetInfo names, "
                        "which must then exist at that path on this host)")
    p.add_argument("--served-model-name", type=_or_none, metavar="NAME",
                   help="the model name clients send and /v1/models lists (default: the "
                        "checkpoint's name as given)")
    p.add_argument("--api-key-file", type=_or_none, metavar="FILE",
                   help="keys, one a line: /v1 requests without 'Authorization: Bearer "
                        "<one of them>' get 401 (/health and /metrics stay open)")
    add_client_tls(p, "--tls", "--verify-api-key-file")
    p.add_argument("--wait-verify-s", type=float, metavar="S",
                   help="at start, wait this long for the verify to be healthy (default 600)")
    p.add_argument("--grace-s", type=float, metavar="S",
                   help="on SIGTERM, let running responses finish this long (default 5)")


def config(args: argparse.Namespace):
    from treespec.common.openai.config import OpenAIConfig
    for name in ("tls_ca", "tls_cert", "tls_key", "verify_api_key_file"):
        setattr(args, name, getattr(args, name) or None)
    check_model(args.model)
    try:
        return OpenAIConfig(verify=args.verify, **given(args, FLAGS))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    from treespec.common.serving.bind import BindError, check_bindable
    cfg = config(args)
    try:
        check_bindable(cfg.host, cfg.port, "--port")
    except BindError as e:
        raise ConfigError(str(e)) from None
    from treespec.common.openai import server
    try:
        server.run(cfg)
    except ValueError as e:              # the tokenizer's checkpoint is not on this host
        raise ConfigError(str(e)) from None
    except TimeoutError as e:
        raise ConfigError(f"the verify service: {e}") from None
    return 0
