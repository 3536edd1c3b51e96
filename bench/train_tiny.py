"""Train the tiny Qwen3 family on the Python standard library.

    python bench/train_tiny.py --out DIR [--device cuda] [--minutes-budget 6] [--seed 0]
    python bench/train_tiny.py --out DIR --tiny --max-files 20 --steps 30   # CPU smoke
    python bench/train_tiny.py --out DIR --only dflash --base common/model/checkpoints

Writes DIR/tiny-code (target, Qwen3 ~8 M params), DIR/tiny-code-draft (Qwen3 < 2 M),
DIR/tiny-code-eagle3 (EAGLE-3 head, layout in bench/train_tiny/eagle3.py), each with
config.json, model.safetensors, generation_config.json and the tokenizer, and
DIR/TRAINING.json (settings, corpus, held-out files, losses, acceptance, wall time).
With --only dflash: DIR/tiny-code-dflash alone, a DFlash drafter (layout in
bench/train_tiny/dflash.py) for the target in --base, with its own TRAINING.json.

Measured on one H200 (torch 2.11, transformers 5.17, Python 3.12 stdlib: 494 training
files, 2.69 M tokens), default settings: 238 s in all (target 1000 steps 42 s, 4096 greedy
continuations 8 s, draft 2500 steps 77 s, EAGLE-3 2500 steps 105 s, evaluation 2.5 s);
held-out loss target 3.18, draft 3.21 nats/token; greedy chain-4 on held-out prompts:
draft 3.23, EAGLE-3 3.13 mean tokens per step. --minutes-budget (default 6) caps each
stage at its share: a stage that would overrun shrinks its step count (the whole warmup +
cosine schedule still runs), so a slower machine trains less rather than longer.
Bitwise reproducible on CPU for a given seed and stdlib; on CUDA only statistically
(non-deterministic attention and embedding backward kernels).
"""

from __future__ import annotations

import sys


from train_tiny.main import main

if __name__ == "__main__":
    sys.exit(main())
