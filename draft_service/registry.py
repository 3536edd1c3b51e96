"""Draft method name -> proposer factory. The one place a method is chosen."""

from __future__ import annotations

from collections.abc import Callable

from draft_service.config import DraftConfig, Method
from draft_service.model_proposer import ModelProposer
from draft_service.ngram import NgramProposer
from draft_service.proposer import Proposer


def _eagle3(cfg: DraftConfig) -> Proposer:
    raise NotImplementedError("eagle3 is not implemented yet; use --method ngram or model")


PROPOSERS: dict[Method, Callable[[DraftConfig], Proposer]] = {
    "ngram": NgramProposer,
    "model": ModelProposer.from_config,
    "eagle3": _eagle3,
}


def build_proposer(cfg: DraftConfig) -> Proposer:
    return PROPOSERS[cfg.method](cfg)
