"""Every knob of the tiny-family training run, built from the command line in one place."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class LMShape:
    """A Qwen3 decoder's numbers (the fields of transformers.Qwen3Config we set)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


@dataclass(frozen=True)
class StageSettings:
    steps: int
    batch: int          # sequences per step
    lr: float
    warmup: int
    budget_share: float  # share of --minutes-budget this stage may use


@dataclass(frozen=True)
class Settings:
    out: str
    device: str
    seed: int = 0
    minutes_budget: float = 6.0
    max_files: int | None = None        # keep a deterministic subset of training files
    vocab_size: int = 6144
    draft_vocab_size: int = 3072
    seq_len: int = 512
    max_position: int = 2048
    rope_theta: float = 10000.0
    target: LMShape = LMShape(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64,
                              intermediate=768)
    draft: LMShape = LMShape(hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32,
                             intermediate=512)
    eagle_intermediate: int = 768
    ttt_steps: int = 4                  # EAGLE-3 unrolled steps (1 = plain next-token)
    # 1000 target steps ≈ 6 epochs of the 3.12 stdlib: held-out loss is lowest near there
    # (an H200 run at 3000 steps fell to 0.48 train / rose to 4.45 held-out nats).
    target_stage: StageSettings = StageSettings(steps=1000, batch=32, lr=2e-3, warmup=100,
                                                budget_share=0.22)
    draft_stage: StageSettings = StageSettings(steps=2500, batch=32, lr=3e-3, warmup=50,
                                               budget_share=0.33)
    eagle_stage: StageSettings = StageSettings(steps=2500, batch=32, lr=2e-3, warmup=50,
                                               budget_share=0.30)
    # the DFlash drafter (--only dflash: trained against the target already in --base)
    dflash_layers: int = 3
    dflash_block: int = 16
    dflash_anchors: int = 8             # blocks drawn per training window
    dflash_gamma: float = 7.0           # loss weight exp(-(k - 1) / gamma) at block position k
    dflash_init: str | None = None      # a DFlash drafter to go on training from
    dflash_stage: StageSettings = StageSettings(steps=3000, batch=32, lr=2e-3, warmup=100,
                                                budget_share=0.8)
    only: str | None = None             # "dflash": train the DFlash drafter alone
    base: str | None = None             # --only's target (and tokenizer) checkpoints' dir
    gen_seqs: int = 4096                # target-greedy sequences for draft/EAGLE distillation
    gen_prompt_len: int = 128
    gen_len: int = 128
    gen_mix: float = 0.7                # share of distillation steps on generated sequences
    gen_starts: float = 0.0             # DFlash: share of the generated prompts that begin
                                        # within 64 tokens of a training file's start
    eval_prompts: int = 48
    eval_prompt_len: int = 128
    eval_new_tokens: int = 64
    eval_chain: int = 4
    loss_eval_windows: int = 64
    log_every: int = 100
    eval_every: int = 500                # held-out report inside a stage (0: only at its end)
    save_dtype: str = "bfloat16"
    compile: bool = False
    tiny: bool = False

    def as_json(self) -> dict:
        return asdict(self)


def tiny_settings(base: Settings) -> Settings:
    """A CPU smoke configuration: same pipeline, toy sizes."""
    stage = StageSettings(steps=60, batch=8, lr=3e-3, warmup=5, budget_share=0.25)
    return replace(base, tiny=True, vocab_size=1024, draft_vocab_size=256, seq_len=64,
                   target=LMShape(hidden=64, layers=5, heads=2, kv_heads=1, head_dim=32,
                                  intermediate=128),
                   draft=LMShape(hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16,
                                 intermediate=64),
                   eagle_intermediate=128, ttt_steps=3, dflash_layers=1, dflash_block=8,
                   target_stage=stage, draft_stage=stage, eagle_stage=stage,
                   dflash_stage=stage,
                   gen_seqs=8, gen_prompt_len=16, gen_len=16,
                   eval_prompts=2, eval_prompt_len=32, eval_new_tokens=12,
                   loss_eval_windows=4, log_every=10, eval_every=0, minutes_budget=1.5,
                   max_files=base.max_files if base.max_files is not None else 60)


def parse_args(argv: list[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(
        prog="python bench/train_tiny.py",
        description="Train the tiny Qwen3 family (target, draft, EAGLE-3 head; or with "
                    "--only dflash a DFlash drafter for an existing target) on the Python "
                    "standard library and save HF-layout checkpoints.")
    p.add_argument("--out", required=True, help="directory that receives the three checkpoints")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes-budget", type=float, default=None,
                   help="wall-clock cap; each stage shrinks its step count to fit its share")
    p.add_argument("--tiny", action="store_true", help="toy sizes for a CPU smoke run")
    p.add_argument("--max-files", type=int, default=None,
                   help="train on a deterministic subset of this many files")
    p.add_argument("--steps", type=int, default=None, help="steps of every training stage")
    p.add_argument("--target-steps", type=int, default=None)
    p.add_argument("--draft-steps", type=int, default=None)
    p.add_argument("--eagle-steps", type=int, default=None)
    p.add_argument("--dflash-steps", type=int, default=None)
    p.add_argument("--only", choices=["dflash"],
                   help="train only this drafter, against the target in --base")
    p.add_argument("--base", help="--only's checkpoints dir (holding tiny-code)")
    p.add_argument("--seq-len", type=int, default=None, help="training window length")
    p.add_argument("--dflash-batch", type=int, default=None, help="windows per DFlash step")
    p.add_argument("--dflash-lr", type=float, default=None, help="DFlash peak learning rate")
    p.add_argument("--gen-seqs", type=int, default=None,
                   help="target-greedy sequences generated for distillation (0: real text only)")
    p.add_argument("--gen-mix", type=float, default=None,
                   help="share of distillation steps on generated sequences")
    p.add_argument("--gen-starts", type=float, default=None,
                   help="DFlash: share of generated prompts near a training file's start "
                        "(where bench-accept's prompts are)")
    p.add_argument("--dflash-layers", type=int, default=None, help="DFlash drafter layers")
    p.add_argument("--dflash-anchors", type=int, default=None,
                   help="DFlash blocks drawn per training window")
    p.add_argument("--dflash-gamma", type=float, default=None,
                   help="DFlash loss weight decay over block positions")
    p.add_argument("--dflash-init", default=None,
                   help="with --only dflash: go on training this DFlash drafter")
    p.add_argument("--eval-prompts", type=int, default=None)
    p.add_argument("--log-every", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--compile", action="store_true", help="torch.compile the training forwards")
    a = p.parse_args(argv)

    import torch
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.only and not a.base:
        p.error("--only needs --base (the dir holding the target it drafts for)")
    s = Settings(out=a.out, device=device, seed=a.seed, max_files=a.max_files,
                 compile=a.compile, only=a.only, base=a.base)
    if a.tiny:
        s = tiny_settings(s)
    if a.minutes_budget is not None:
        s = replace(s, minutes_budget=a.minutes_budget)
    for name, flag in (("target_stage", a.target_steps), ("draft_stage", a.draft_steps),
                       ("eagle_stage", a.eagle_steps), ("dflash_stage", a.dflash_steps)):
        steps = flag if flag is not None else a.steps
        if steps is not None:
            stage = getattr(s, name)
            s = replace(s, **{name: replace(stage, steps=steps,
                                            warmup=min(stage.warmup, max(1, steps // 10)))})
    if a.seq_len is not None:
        s = replace(s, seq_len=a.seq_len)
    if a.dflash_batch is not None:
        s = replace(s, dflash_stage=replace(s.dflash_stage, batch=a.dflash_batch))
    if a.dflash_lr is not None:
        s = replace(s, dflash_stage=replace(s.dflash_stage, lr=a.dflash_lr))
    for name in ("gen_seqs", "gen_mix", "gen_starts", "dflash_init", "dflash_layers",
                 "dflash_anchors", "dflash_gamma", "eval_prompts", "log_every", "eval_every"):
        if getattr(a, name) is not None:
            s = replace(s, **{name: getattr(a, name)})
    return s

