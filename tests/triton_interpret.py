"""Import this before any kernel module in a Triton test: it turns on Triton's
interpreter (unless TRITON_INTERPRET is already set, e.g. to 0 on a GPU) and
re-imports kernel modules decorated before it was on."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
INTERPRET = os.environ["TRITON_INTERPRET"] not in ("0", "", "false", "False")
DEV = torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")


def load(name: str) -> ModuleType:
    """Import (or re-import, should an earlier import predate TRITON_INTERPRET)."""
    mod = sys.modules.get(name)
    return importlib.reload(mod) if mod is not None else importlib.import_module(name)
