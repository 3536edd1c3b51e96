"""Train the tiny Qwen3 family on the Python standard library.

    python bench/train_tiny.py --out DIR [--device cuda] [--minutes-budget 6] [--seed 0]
    python bench/train_tiny.py --out DIR --tiny --max-files 20 --steps 30   # CPU smoke

Writes DIR/tiny-code (target, Qwen3 ~8 M params), DIR/tiny-code-draft (Qwen3 < 2 M),
DIR/tiny-code-eagle3 (EAGLE-3 head, layout in bench/train_tiny/eagle3.py), each with
config.json, model.safetensors, generation_config.json and the tokenizer, and
DIR/TRAINING.json (settings, corpus, held-out files, losses, acceptance, wall time).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train_tiny.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
