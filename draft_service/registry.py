"""Draft method name -> proposer factory. The one place a method is chosen."""

from __future__ import annotations

from collections.abc import Callable

from draft_service.config import DraftConfig, Method
from draft_service.eagle3_proposer import Eagle3Proposer
from draft_service.model_proposer import ModelProposer
from draft_service.ngram import NgramProposer
from draft_service.proposer import Proposer


PROPOSERS: dict[Method, Callable[[DraftConfig], Proposer]] = {
    "ngram": NgramProposer,
    "model": ModelProposer.from_config,
    "eagle3": Eagle3Proposer.from_config,
}


def build_proposer(cfg: DraftConfig) -> Proposer:
    return PROPOSERS[cfg.method](cfg)
