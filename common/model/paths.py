"""Where a --model value points: a checkpoint directory, or a checkpoint the package ships."""

from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent / "checkpoints"
SHIPPED_NAMES = ("tiny-code", "tiny-code-draft", "tiny-code-eagle3", "tiny-code-dflash")
# each draft method's shipped checkpoint for the shipped target (ngram needs none)
SHIPPED_DRAFTS = {"model": "tiny-code-draft", "ngram": None, "eagle3": "tiny-code-eagle3",
                  "dflash": "tiny-code-dflash"}


def resolve_model(name_or_dir: str) -> Path:
    if name_or_dir in SHIPPED_NAMES:
        path = SHIPPED_DIR / name_or_dir
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"shipped checkpoint {name_or_dir!r} is missing from {SHIPPED_DIR}")
        return path
    path = Path(name_or_dir).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{name_or_dir!r} is neither a checkpoint directory "
                                f"(no config.json) nor one of {SHIPPED_NAMES}")
    return path
