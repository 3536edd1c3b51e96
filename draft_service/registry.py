"""Draft method name -> proposer class (config.METHODS names the methods and says which
load a checkpoint; a test holds the two to the same names)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from treespec.draft_service.dflash_proposer import DFlashProposer
from treespec.draft_service.eagle3_proposer import Eagle3Proposer
from treespec.draft_service.model_proposer import ModelProposer
from treespec.draft_service.ngram import NgramProposer
from treespec.draft_service.proposer import Proposer

if TYPE_CHECKING:
    from treespec.draft_service.config import DraftConfig

PROPOSERS: dict[str, type[Proposer]] = {
    "ngram": NgramProposer,
    "model": ModelProposer,
    "eagle3": Eagle3Proposer,
    "dflash": DFlashProposer,
}


def build_proposer(cfg: DraftConfig) -> Proposer:
    """The configured method's proposer, loaded (and warmed up on a GPU)."""
    return PROPOSERS[cfg.method].from_config(cfg)
