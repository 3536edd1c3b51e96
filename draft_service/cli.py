"""`treespec draft`: its flags, the DraftConfig they make, and serving it."""

from __future__ import annotations

import argparse

from treespec.common import cli
from treespec.common.cli import RUNTIME, ConfigError, add_runtime, check_model, given, int_list

SERVER = "treespec.draft_service.server"


def add_arguments(d: argparse.ArgumentParser) -> None:
    from treespec.draft_service.config import METHODS
    d.add_argument("--method", required=True, choices=list(METHODS))
    d.add_argument("--model", help="draft checkpoint dir or shipped name (model, eagle3, "
                   "dflash)")
    d.add_argument("--target-embeddings", metavar="PATH", type=lambda t: t or None,
                   help="eagle3 head without embed_tokens: the target's checkpoint dir or a "
                   "safetensors file holding model.embed_tokens.weight; dflash: the "
                   "target's checkpoint dir (its embedding and LM head)")
    d.add_argument("--envelope", help="tree preset: chain4 (default; dflash: its block's "
                   "tree, block8-tree or block16-tree), tree-small, tree-wide, block8, "
                   "block16")
    d.add_argument("--depth", type=int, help="custom envelope: longest path, in nodes")
    d.add_argument("--topk", type=int, help="custom envelope: children per expanded node")
    d.add_argument("--nodes", type=int, help="custom envelope: nodes per tree")
    d.add_argument("--ngram-max", type=int, help="longest suffix the n-gram proposer matches")
    d.add_argument("--ngram-min", type=int, help="shortest suffix the n-gram proposer matches")
    d.add_argument("--max-sequences", type=int, help="sequences whose state the draft keeps")
    d.add_argument("--max-model-len", type=int,
                   help="committed tokens a sequence may have (default 131072)")
    d.add_argument("--draft-sampling", choices=["sample", "deterministic"],
                   help="how model drafters draft a sampling request: sample (default: "
                        "they draw with the request's seeded noise, as its acceptance "
                        "needs) or deterministic (the top-k by log-prob, as for greedy)")
    d.add_argument("--lookahead", type=int, metavar="K",
                   help="candidate trees to pre-draft per sequence for its next step while "
                        "the verify service runs this one (default 0: off; the draft model "
                        "and n-gram; a hit costs the next step no drafting)")
    d.add_argument("--local-socket", metavar="auto|off|PATH",
                   help="also serve the per-step stream on a Unix socket, which a verify "
                        "service on this host then uses instead of gRPC (default auto: "
                        "an abstract socket on Linux; off; PATH or @name to share it across "
                        "containers through a volume)")
    d.add_argument("--local-socket-uids", type=lambda t: tuple(int_list(t)), metavar="1000,1001",
                   help="users besides this one whose processes may use the local socket "
                        "(a verify service in another container runs as another uid)")
    add_runtime(d)


def config(args: argparse.Namespace):
    """DraftConfig from parsed flags; ConfigError when it is refused."""
    from treespec.common.model.paths import resolve_model
    from treespec.common.spec.tree import envelope_from
    from treespec.draft_service.config import DraftConfig
    check_model(args.model)
    try:
        env = envelope_from(args.envelope, args.depth, args.topk, args.nodes)
        if args.method == "dflash" and args.model:
            from treespec.draft_service.dflash_head import checked_source
            spec, _ = checked_source(resolve_model(args.model), args.target_embeddings)
            if args.envelope is None and args.depth is None:
                env = block_envelope(spec.block_size)
            if env.depth > spec.block_size - 1:
                raise ValueError(f"envelope {env.name} is {env.depth} deep; this DFlash "
                                 f"block of {spec.block_size} drafts {spec.block_size - 1}")
        cfg = DraftConfig(method=args.method, envelope=env, model=args.model,
                          **given(args, RUNTIME + ("ngram_max", "ngram_min", "max_sequences",
                                                   "target_embeddings", "local_socket",
                                                   "draft_sampling", "local_socket_uids",
                                                   "max_model_len", "lookahead")))
        if cfg.method == "eagle3":
            from treespec.draft_service.eagle3_head import embedding_source
            embedding_source(resolve_model(cfg.model), cfg.target_embeddings)
        return cfg
    except ValueError as e:
        raise ConfigError(str(e)) from None


def block_envelope(block_size: int):
    """A DFlash drafter's default envelope: a tree of each block position's top 4, as
    many nodes as the block's chain (the same verify rows, more tokens a step)."""
    from treespec.common.spec.tree import TreeEnvelope
    return TreeEnvelope(depth=block_size - 1, topk=4, num_nodes=block_size - 1,
                        name=f"block{block_size}-tree")


def run(args: argparse.Namespace) -> int:
    cli.run_server(SERVER, config(args))
    return 0
