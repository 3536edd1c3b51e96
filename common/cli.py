"""The `treespec` command: hands a subcommand to the module that owns it, by name.

    treespec draft ...              draft_service/cli.py
    treespec verify ...             verify_service/cli.py
    treespec generate | health ...  common/client/cli.py
    treespec demo ...               common/client/demo.py
    treespec openai ...             common/openai/cli.py

Each owner adds its flags to the subcommand's parser and runs it; the argument
helpers both services use and the one place a server module is started
(``run_server``) are here. Only the chosen subcommand's module is imported, so
`treespec generate` loads neither torch nor a model.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import sys
from collections.abc import Sequence

# name -> (module, its add-arguments function, its run function, one-line help)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "draft": ("treespec.draft_service.cli", "add_arguments", "run",
              "serve the Drafter service (proposes token trees)"),
    "verify": ("treespec.verify_service.cli", "add_arguments", "run",
               "serve the Generation service (the Qwen3 target)"),
    "generate": ("treespec.common.client.cli", "add_generate_arguments", "generate",
                 "stream one completion from a verify service"),
    "health": ("treespec.common.client.cli", "add_health_arguments", "health",
               "exit 0 when a service's gRPC health says SERVING"),
    "demo": ("treespec.common.client.demo", "add_arguments", "run_demo",
             "start both services locally and compare with plain decode"),
    "openai": ("treespec.common.openai.cli", "add_arguments", "run",
               "serve an OpenAI-compatible HTTP API in front of a verify service"),
}


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


RUNTIME = ("host", "port", "device", "dtype", "kernels", "num_blocks", "block_size",
           "prefix_caching",
           "metrics_port", "tls_cert", "tls_key", "tls_client_ca", "api_key_file", "reflection")


def add_runtime(p: argparse.ArgumentParser) -> None:
    """The flags of treespec.common.serving.config.ServiceConfig."""
    p.add_argument("--port", type=int, required=True, help="port to bind; 0 picks a free one")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--device", help="auto (first GPU, else CPU), cpu, cuda:1, ... (default auto)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (default auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--kernels", choices=["auto", "reference", "triton"],
                   help="kernel backend (default auto)")
    p.add_argument("--num-blocks", type=int, help="KV cache pages")
    p.add_argument("--block-size", type=int, help="tokens per KV page")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_const",
                   const=False, help="compute every prompt's KV anew (default: full KV pages "
                   "of a prefix seen before are reused)")
    p.add_argument("--metrics-port", type=int, metavar="P",
                   help="serve Prometheus /metrics on P (0 picks a free one; default off)")
    p.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    p.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    p.add_argument("--tls-client-ca", metavar="PEM",
                   help="mutual TLS: refuse clients without a certificate of this CA")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="bearer tokens, one a line: calls without one of them get "
                        "UNAUTHENTICATED (health checks stay open)")
    p.add_argument("--reflection", choices=["auto", "on", "off"],
                   help="serve gRPC reflection (default auto: only on a loopback address)")


def add_client_tls(p: argparse.ArgumentParser, prefix: str = "--tls",
                   key_flag: str = "--api-key-file") -> None:
    """A client's flags: TLS (PREFIX-ca, PREFIX-cert, PREFIX-key) and its bearer token."""
    p.add_argument(f"{prefix}-ca", metavar="PEM",
                   help="speak TLS, trusting this CA for the server's certificate")
    p.add_argument(f"{prefix}-cert", metavar="PEM", help="mutual TLS: this client's certificate")
    p.add_argument(f"{prefix}-key", metavar="PEM", help="and its private key")
    p.add_argument(key_flag, metavar="FILE",
                   help="send the first token of this file as a bearer token")


def given(args: argparse.Namespace, names: Sequence[str]) -> dict:
    """The flags that were given, as config keyword arguments; the rest keep config defaults."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def check_model(name: str | None) -> None:
    """ConfigError unless name is a checkpoint dir or a shipped checkpoint (or None)."""
    from treespec.common.model.paths import resolve_model
    if name is not None:
        try:
            resolve_model(name)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None


def run_server(module: str, cfg) -> None:
    """Blocks in `module.run(cfg)`, which prints `listening on HOST:PORT` once bound.

    cfg's ports are tried first (before the module is imported): a port in use or a
    host that is not this machine's is a ConfigError naming the flag, as is a bind
    that fails later.
    """
    from treespec.common.serving.bind import BindError, check_bindable
    try:
        check_bindable(cfg.host, cfg.port, "--port")
        if cfg.metrics_port:
            check_bindable(cfg.host, cfg.metrics_port, "--metrics-port")
        try:
            server = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name not in (module, module.split(".")[0]):
                raise
            raise ConfigError(f"{module} is not part of this install") from None
        server.run(cfg)
    except BindError as e:
        raise ConfigError(str(e)) from None
    # Stopped cleanly: leave without the interpreter's teardown, in which native
    # extensions (triton's nanobind bindings) print ~30 lines of "leaked" objects
    # that read like a crash. Exit handlers (trace export) and logs still run first.
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _loaded(module: str, name: str) -> tuple[type[BaseException], ...]:
    """(module.name,) when module was imported, else (): an except clause over an error
    type that only a loaded module can raise, without importing it (the checkpoint
    module imports torch, which a refusal or `treespec generate` need not wait for)."""
    mod = sys.modules.get(module)
    return (getattr(mod, name),) if mod is not None else ()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        top = argparse.ArgumentParser(prog="treespec", description=__doc__.split("\n")[0])
        top.add_argument("command", choices=list(COMMANDS), metavar="COMMAND",
                         help="; ".join(f"{k}: {v[3]}" for k, v in COMMANDS.items()))
        top.parse_args(argv[:1])            # prints help (exit 0) or the error (exit 2)
        return 2
    name = argv[0]
    module_name, add, run, about = COMMANDS[name]
    prog = f"treespec {name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name not in (module_name, module_name.split(".")[0]):
            raise
        print(f"{prog}: error: {module_name} is not part of this install", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=prog, description=about)
    getattr(module, add)(parser)
    args = parser.parse_args(argv[1:])
    try:
        return getattr(module, run)(args) or 0
    except (ConfigError, NotImplementedError,
            *_loaded("treespec.common.model.checkpoint", "CheckpointError")) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except _loaded("treespec.common.client.sdk", "TreespecError") as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # `python -m treespec.common.cli`: run the importable module's main, so that the subcommand
    # modules' ConfigError (imported from treespec.common.cli) is the one caught here
    from treespec.common.cli import main as _main
    sys.exit(_main())
