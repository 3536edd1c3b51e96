"""Draft method name -> proposer factory. The one place a method is chosen."""

from __future__ import annotations

import logging
from collections.abc import Callable

from common.devices import pick_device

from draft_service.config import DraftConfig, Method
from draft_service.eagle3_proposer import Eagle3Proposer
from draft_service.model_proposer import ModelProposer
from draft_service.ngram import NgramProposer
from draft_service.proposer import Proposer, warm_up

log = logging.getLogger("treespec.draft")


PROPOSERS: dict[Method, Callable[[DraftConfig], Proposer]] = {
    "ngram": NgramProposer,
    "model": ModelProposer.from_config,
    "eagle3": Eagle3Proposer.from_config,
}


def build_proposer(cfg: DraftConfig) -> Proposer:
    """The method's proposer; a model-backed one on a GPU is warmed up (kernel
    compiles, graph captures) before it serves a step under a deadline."""
    proposer = PROPOSERS[cfg.method](cfg)
    if cfg.method != "ngram" and pick_device(cfg.device).type == "cuda":
        log.info("%s warm-up (kernel compiles, graph captures) took %.1f s", cfg.method,
                 warm_up(proposer))
    return proposer
