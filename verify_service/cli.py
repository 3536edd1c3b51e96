"""`treespec verify`: its flags, the VerifyConfig they make, and serving it."""

from __future__ import annotations

import argparse

from treespec.common import cli
from treespec.common.cli import RUNTIME, ConfigError, add_client_tls, add_runtime, check_model, given

SERVER = "treespec.verify_service.server"


def add_arguments(v: argparse.ArgumentParser) -> None:
    v.add_argument("--model", required=True, help="target checkpoint dir or shipped name")
    v.add_argument("--draft", metavar="HOST:PORT", help="draft service; omit for plain decode")
    v.add_argument("--max-batch", type=int, help="running sequences per step")
    v.add_argument("--max-model-len", type=int, help="0 = the checkpoint's context")
    v.add_argument("--prefill-tokens", type=int,
                   help="prompt tokens prefilled per iteration (default 4096): a longer "
                        "prompt is prefilled in chunks, between decode steps")
    v.add_argument("--max-prompt-bytes", type=int,
                   help="refuse a text prompt longer than this, unread (default 1 MiB)")
    v.add_argument("--max-waiting", type=int,
                   help="requests that may wait for a batch slot; more get "
                        "RESOURCE_EXHAUSTED (default 1024)")
    v.add_argument("--step-deadline-ms", type=float, help="wait for a proposal, then plain decode")
    v.add_argument("--reconnect-s", type=float, help="retry period while the draft is down")
    v.add_argument("--draft-socket", choices=["auto", "off"],
                   help="carry draft steps over the draft's local socket when this process "
                        "reaches it (same host), else over the gRPC stream (default auto); "
                        "off: always gRPC")
    v.add_argument("--generation-config", choices=["auto", "none"],
                   help="what a request's unset sampling fields mean: auto (default) the "
                        "checkpoint's generation_config.json (as vLLM), none greedy")
    v.add_argument("--acceptance", choices=["rejection", "coupled"],
                   help="how a sampling request's draft nodes are accepted: coupled "
                        "(default: iff the node is the target's seeded draw, so the tokens "
                        "are the same with any drafter or none) or rejection (recursive "
                        "rejection sampling with the drafter's q)")
    v.add_argument("--speculation", choices=["adaptive", "always", "off"],
                   help="how much each step speculates: adaptive (default: a depth chosen "
                        "per step from measured step times and acceptance, none when plain "
                        "decode is faster), always (the whole envelope), off (never ask "
                        "the draft)")
    v.add_argument("--busy-poll", choices=["auto", "on", "off"],
                   help="wait for the draft's answer and the device without sleeping (one "
                        "busy core while steps run; default auto: on when the device is CUDA)")
    v.add_argument("--batch-invariant", choices=["on", "off"],
                   help="kernels whose rows' bits do not depend on the batch, so speculation "
                        "never changes a token: on (default) runs Triton's invariant GEMMs "
                        "and tree attention where --kernels is auto or triton (the CPU "
                        "reference always is); off: the fastest kernels, exact only up to "
                        "bf16 rounding")
    add_runtime(v)
    add_client_tls(v, "--draft-tls", "--draft-api-key-file")


def config(args: argparse.Namespace):
    """VerifyConfig from parsed flags; ConfigError when it is refused."""
    from treespec.verify_service.config import VerifyConfig
    check_model(args.model)
    if getattr(args, "batch_invariant", None) is not None:
        args.batch_invariant = args.batch_invariant == "on"
    try:
        cfg = VerifyConfig(model=args.model, draft=args.draft, **given(
            args, RUNTIME + ("max_batch", "max_model_len", "prefill_tokens",
                             "step_deadline_ms", "reconnect_s", "draft_socket", "busy_poll",
                             "generation_config", "acceptance", "speculation", "draft_tls_ca",
                             "draft_tls_cert", "draft_tls_key", "draft_api_key_file",
                             "max_prompt_bytes", "max_waiting", "batch_invariant")))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    limit = checkpoint_positions(cfg.model)
    if limit and cfg.max_model_len > limit:
        raise ConfigError(f"--max-model-len {cfg.max_model_len} is past the checkpoint's "
                          f"{limit} positions (max_position_embeddings)")
    return cfg


def checkpoint_positions(model: str) -> int:
    """The checkpoint's max_position_embeddings (0 when it does not say)."""
    import json
    from treespec.common.model.paths import resolve_model
    cfg = json.loads((resolve_model(model) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or 0)


def run(args: argparse.Namespace) -> int:
    cli.run_server(SERVER, config(args))
    return 0
