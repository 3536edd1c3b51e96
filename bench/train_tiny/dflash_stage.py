"""``--only dflash``: train a DFlash drafter (bench/train_tiny/dflash.py) for a target
that is already trained (``--base``: its checkpoint and tokenizer), on the same corpus
split, from the target's own hidden states; save it as tiny-code-dflash with its
TRAINING.json.

Data: windows of the training text and the target's greedy continuations of training
prompts (``gen_mix`` of the steps), as for the draft and the EAGLE-3 head. Each step
draws ``dflash_anchors`` random anchors a per window: block [x_a, mask x (B - 1)], the
context the target's features at positions < a, cross-entropy of positions 1 .. B-1
weighted toward the early ones. The held-out report is the teacher-forced tokens per
step of a greedy chain on the target's continuations of held-out prompts (windows inside
the files, and the files' starts, which are bench-accept's prompts), walked as serving
walks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast

from train_tiny import corpus as C
from train_tiny import dflash as DF
from train_tiny import distill as D
from train_tiny import lm
from train_tiny.settings import Settings
from train_tiny.train_loop import run_stage
from bench_accept import file_start_prompts
from treespec.draft_service.dflash_head import default_layer_ids

NAME = "tiny-code-dflash"


def run_dflash(s: Settings) -> dict:
    t0 = time.perf_counter()
    dev = torch.device(s.device)
    torch.manual_seed(s.seed)
    base = Path(s.base) / "tiny-code"
    target = lm.load_lm(base, dev)
    tok = PreTrainedTokenizerFast.from_pretrained(base)
    corpus = C.load_corpus(s.max_files)
    train = C.encode_stream(tok, corpus.train_texts)
    held = C.encode_stream(tok, corpus.held_out_texts)
    pool = None
    if s.gen_seqs > 0:      # prompts anywhere, and a gen_starts share near files' starts
        near = round(s.gen_seqs * s.gen_starts)
        firsts = C.file_starts(train, tok.eos_token_id, s.gen_prompt_len, 64) if near else None
        parts = [(s.gen_seqs - near, None), (near, firsts)]
        pool = torch.cat([D.generate_pool(target, C.WindowSampler(train, s.gen_prompt_len,
                                                                  seed=s.seed + 2 + i, starts=at),
                                          n, s.gen_len, dev,
                                          batch=2048 if dev.type == "cuda" else 256)
                          for i, (n, at) in enumerate(parts) if n])

    tcfg = target.config.to_dict()
    ids = default_layer_ids(tcfg["num_hidden_layers"], s.dflash_layers)
    cfg = DF.drafter_config(tcfg, s.dflash_layers, s.dflash_block,
                            mask_token_id=tcfg["vocab_size"] - 1, layer_ids=ids)
    model = DF.DFlashDrafter(cfg)
    if s.dflash_init:                  # go on from a drafter trained before
        model.load_state_dict({k: v.float() for k, v in
                               load_file(str(Path(s.dflash_init) / "model.safetensors")).items()})
    model = model.to(dev)
    tap = D.TargetTap(target, [i + 1 for i in ids])
    embed = target.model.embed_tokens.weight.detach()
    head = target.lm_head.weight.detach()
    st = s.dflash_stage
    batches = D.MixedBatches(C.WindowSampler(train, s.seq_len, seed=s.seed + 10), pool,
                             s.gen_mix, st.batch, seed=s.seed + 11)
    gen = torch.Generator().manual_seed(s.seed + 12)
    # two held-out probes: windows inside files, and the files' starts (bench-accept's
    # prompts, where the README's tokens a step come from)
    n = s.eval_prompt_len
    starts = torch.tensor([p for p in file_start_prompts(
        tok, corpus.held_out_texts[:s.eval_prompts], n) if len(p) == n])
    probes = [lm.greedy_continue(target, p.to(dev), s.eval_new_tokens) for p in
              (C.fixed_windows(held, n, s.eval_prompts), starts)]
    probes = [(p, tap(p, logits=False)[1]) for p in probes]

    def acceptance() -> tuple[float, float]:
        return tuple(DF.chain_acceptance(model, f, p, s.eval_prompt_len, embed, head)
                     for p, f in probes)

    def loss(step: int) -> torch.Tensor:
        b = batches(step).to(dev)
        # a generated sequence's blocks lie in its continuation: serving drafts the
        # target's own tokens, not the text its prompt came from
        low = s.gen_prompt_len - 1 if batches.generated(step) else 1
        return DF.block_loss(model, tap(b, logits=False)[1], b, embed, head, s.dflash_anchors,
                             s.dflash_gamma, gen, low)

    def report() -> str:
        return ("greedy block-{} chain, tokens/step: windows {:.3f}, file starts {:.3f}"
                .format(s.dflash_block, *acceptance()))

    res = run_stage("dflash", list(model.parameters()), loss, st,
                    60.0 * s.minutes_budget * st.budget_share, dev, s.log_every, report,
                    s.eval_every)
    with torch.no_grad():
        per_step, at_starts = acceptance()
    tap.close()
    path = Path(s.out) / NAME
    DF.save_drafter(model, path, lm.SAVE_DTYPES[s.save_dtype])
    lm.save_tokenizer(tok, path)
    eos = tok.eos_token_id
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "pad_token_id": eos}, indent=2) + "\n")
    report_json = {
        "settings": s.as_json(), "target": str(base), "target_layer_ids": ids,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "corpus": corpus.stats(), "stage": res.as_json(),
        "held_out_teacher_forced_tokens_per_step": per_step,
        "held_out_file_starts_tokens_per_step": at_starts,
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": (path / "model.safetensors").stat().st_size,
        "wall_seconds": time.perf_counter() - t0}
    (path / "TRAINING.json").write_text(json.dumps(report_json, indent=2) + "\n")
    print(f"[train_tiny] dflash: {per_step:.3f} / {at_starts:.3f} tokens/step (held-out "
          "windows / file starts, teacher-forced) "
          f"in {report_json['wall_seconds']:.1f}s -> {path}", flush=True)
    return report_json
