"""Draft method name -> proposer class: the one place a method is named."""

from __future__ import annotations

from typing import TYPE_CHECKING

from draft_service.dflash_proposer import DFlashProposer
from draft_service.eagle3_proposer import Eagle3Proposer
from draft_service.model_proposer import ModelProposer
from draft_service.ngram import NgramProposer
from draft_service.proposer import Proposer

if TYPE_CHECKING:
    from draft_service.config import DraftConfig

PROPOSERS: dict[str, type[Proposer]] = {
    "ngram": NgramProposer,
    "model": ModelProposer,
    "eagle3": Eagle3Proposer,
    "dflash": DFlashProposer,
}


def build_proposer(cfg: DraftConfig) -> Proposer:
    """The configured method's proposer, loaded (and warmed up on a GPU)."""
    return PROPOSERS[cfg.method].from_config(cfg)
