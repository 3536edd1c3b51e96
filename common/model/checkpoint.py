"""Loading HF-format checkpoints: config.json plus model.safetensors or a sharded index."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint that does not fit what loads it (a missing tensor, a wrong shape):
    the CLI says it in one line."""


def tensor_taker(sd: dict[str, torch.Tensor], owner: str):
    """take(name): sd[name], or a CheckpointError saying the owner's checkpoint lacks it."""
    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise CheckpointError(f"{owner} lacks tensor {name!r}")
        return sd[name]
    return take


def safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    return found


def load_state_dict(path: str | Path, dtype: torch.dtype | None = None,
                    device: torch.device | str = "cpu",
                    names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (or only those in names), cast to dtype
    if given."""
    out: dict[str, torch.Tensor] = {}
    for f in safetensor_files(Path(path)):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if names is not None and name not in names:
                    continue
                t = st.get_tensor(name)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                out[name] = t.to(device)
    return out
