"""The pipeline: corpus → tokenizer → target → draft (distilled) → EAGLE-3 head (TTT) →
held-out evaluation → TRAINING.json. See bench/train_tiny.py for the command."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import tokenizers
import torch
import transformers

from bench.train_tiny import corpus as C
from bench.train_tiny import distill as D
from bench.train_tiny import eagle3 as E
from bench.train_tiny import evaluate as V
from bench.train_tiny import lm
from bench.train_tiny.settings import Settings, parse_args
from bench.train_tiny.train_loop import run_stage

NAMES = {"target": "tiny-code", "draft": "tiny-code-draft", "eagle3": "tiny-code-eagle3"}
MAX_TOTAL_BYTES = 30 * 1024 * 1024


def log(msg: str) -> None:
    print(f"[train_tiny] {msg}", flush=True)


def _compiled(model: torch.nn.Module, s: Settings):
    return torch.compile(model, dynamic=False) if s.compile else model


def run(s: Settings) -> dict:
    t_start = time.perf_counter()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(s.device)
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = 60.0 * s.minutes_budget
    torch.manual_seed(s.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    timings: dict[str, float] = {}
    report: dict = {"settings": s.as_json(), "environment": {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}}

    # Corpus and tokenizer.
    t0 = time.perf_counter()
    corpus = C.load_corpus(s.max_files)
    tok = C.train_tokenizer(corpus.train_texts, s.vocab_size, s.max_position)
    train_stream = C.encode_stream(tok, corpus.train_texts)
    held_stream = C.encode_stream(tok, corpus.held_out_texts)
    eos = tok.eos_token_id
    draft_ids, d2t, t2d = C.draft_vocab(train_stream, s.vocab_size, s.draft_vocab_size)
    timings["corpus_and_tokenizer"] = time.perf_counter() - t0
    stats = corpus.stats() | {
        "train_tokens": len(train_stream), "held_out_tokens": len(held_stream),
        "tokenizer_vocab": len(tok), "tokenizer_sha256_16": C.tokenizer_digest(tok),
        "draft_vocab_coverage": float(t2d[train_stream].float().mean())}
    report |= {"corpus": stats, "held_out_files": list(corpus.held_out_files),
               "train_files": list(corpus.train_files)}
    log(f"corpus {stats['train_files']} train files ({stats['train_tokens']} tokens), "
        f"{stats['held_out_files']} held out ({stats['held_out_tokens']} tokens), "
        f"tokenizer {len(tok)} tokens, {timings['corpus_and_tokenizer']:.1f}s")
    held_windows = C.fixed_windows(held_stream, s.seq_len + 1, s.loss_eval_windows)

    # Target.
    target = lm.new_model(s.target, s, eos, seed=s.seed, device=device)
    fwd = _compiled(target, s)
    sampler = C.WindowSampler(train_stream, s.seq_len + 1, seed=s.seed + 1)
    st = s.target_stage
    res_target = run_stage("target", list(target.parameters()),
                           lambda _: lm.next_token_loss(fwd, sampler.sample(st.batch).to(device)),
                           st, budget * st.budget_share, device, s.log_every,
                           lambda: f"loss {V.heldout_loss(target, held_windows, device):.4f}",
                           s.eval_every)
    lm.save_lm(target, tok, out / NAMES["target"], s.save_dtype)
    del target, fwd
    target = lm.load_lm(out / NAMES["target"], device)   # teach with the saved weights

    # Target-greedy continuations for distillation.
    t0 = time.perf_counter()
    pool = None
    if s.gen_seqs > 0:
        prompt_sampler = C.WindowSampler(train_stream, s.gen_prompt_len, seed=s.seed + 2)
        pool = D.generate_pool(target, prompt_sampler, s.gen_seqs, s.gen_len, device,
                               batch=2048 if device.type == "cuda" else 256)
    timings["generate_pool"] = time.perf_counter() - t0
    log(f"generated {0 if pool is None else len(pool)} target continuations "
        f"in {timings['generate_pool']:.1f}s")

    # Draft, distilled from the target.
    draft = lm.new_model(s.draft, s, eos, seed=s.seed + 3, device=device)
    dfwd = _compiled(draft, s)
    sd = s.draft_stage
    batches = D.MixedBatches(C.WindowSampler(train_stream, s.seq_len, seed=s.seed + 4), pool,
                             s.gen_mix, sd.batch, seed=s.seed + 5)
    res_draft = run_stage("draft", list(draft.parameters()),
                          lambda step: lm.distill_loss(dfwd, target, batches(step).to(device)),
                          sd, budget * sd.budget_share, device, s.log_every,
                          lambda: f"loss {V.heldout_loss(draft, held_windows, device):.4f}",
                          s.eval_every)
    lm.save_lm(draft, tok, out / NAMES["draft"], s.save_dtype)
    del draft, dfwd

    # EAGLE-3 head on the target's aux hidden states.
    aux_ids = E.aux_layer_ids(s.target.layers)
    cfg = E.head_config(target.config, s.eagle_intermediate, s.draft_vocab_size, aux_ids,
                        s.save_dtype)
    head = E.new_head(cfg, target, draft_ids, d2t, t2d, seed=s.seed + 6).to(device)
    tap = D.TargetTap(target, aux_ids)
    se = s.eagle_stage
    ebatches = D.MixedBatches(C.WindowSampler(train_stream, s.seq_len, seed=s.seed + 7), pool,
                              s.gen_mix, se.batch, seed=s.seed + 8)
    ids_dev = draft_ids.to(device)
    res_eagle = run_stage("eagle3", list(head.parameters()),
                          lambda step: D.eagle_loss(head, tap, ebatches(step).to(device),
                                                    s.ttt_steps, ids_dev),
                          se, budget * se.budget_share, device, s.log_every,
                          lambda: "top-1 by step " + str([round(x, 3) for x in V.eagle_heldout_top1(
                              head, tap, held_windows[:16, :s.seq_len], s.ttt_steps, device)]),
                          s.eval_every)
    E.save_head(head, out / NAMES["eagle3"], lm.SAVE_DTYPES[s.save_dtype])
    lm.save_tokenizer(tok, out / NAMES["eagle3"])
    (out / NAMES["eagle3"] / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "pad_token_id": eos}, indent=2) + "\n")
    del head
    tap.close()

    # Held-out evaluation of the saved checkpoints.
    t0 = time.perf_counter()
    draft = lm.load_lm(out / NAMES["draft"], device)
    head = E.load_head(out / NAMES["eagle3"], device=device)
    tap = D.TargetTap(target, aux_ids)
    losses = {"target": V.heldout_loss(target, held_windows, device),
              "draft": V.heldout_loss(draft, held_windows, device)}
    top1 = V.eagle_heldout_top1(head, tap, held_windows[:, :s.seq_len], s.ttt_steps, device)
    prompts = C.fixed_windows(held_stream, s.eval_prompt_len, s.eval_prompts)
    acc = V.acceptance(target, prompts, s.eval_new_tokens, s.eval_chain,
                       {"draft": V.draft_proposer(draft, s.eval_chain),
                        "eagle3": V.EagleProposer(head, tap, s.eval_chain)}, device)
    tap.close()
    timings["evaluate"] = time.perf_counter() - t0
    for name, a in acc.items():
        log(f"held-out greedy chain-{s.eval_chain} {name}: "
            f"{a['mean_tokens_per_step']:.3f} tokens/step over {a['steps']} steps, "
            f"acceptance by depth {[round(x, 3) for x in a['acceptance_at_depth']]}")
    log(f"held-out loss target {losses['target']:.4f} draft {losses['draft']:.4f}; "
        f"eagle3 teacher-forced top-1 by step {[round(x, 3) for x in top1]}")

    sizes = {n: (out / d / "model.safetensors").stat().st_size for n, d in NAMES.items()}
    head_params = {k: v.numel() for k, v in head.state_dict().items()}
    report |= {
        "checkpoints": dict(NAMES),
        "params": {"target": lm.num_params(target), "draft": lm.num_params(draft),
                   "eagle3_total": sum(v for k, v in head_params.items()
                                       if k not in ("d2t", "t2d")),
                   "eagle3_without_embed": sum(v for k, v in head_params.items()
                                               if k not in ("d2t", "t2d", "embed_tokens.weight"))},
        "checkpoint_bytes": sizes | {"total": sum(sizes.values())},
        "eagle3": {"aux_layer_ids": aux_ids,
                   "aux_convention": "capture-before: id i = residual stream entering target "
                                     "decoder layer i (= HF output_hidden_states[i])",
                   "ttt_steps": s.ttt_steps, "draft_vocab_size": s.draft_vocab_size},
        "stages": {r.name: r.as_json() for r in (res_target, res_draft, res_eagle)},
        "final_train_loss": {"target": res_target.final_loss, "draft_kl": res_draft.final_loss,
                             "eagle3_ttt": res_eagle.final_loss},
        "held_out_loss": losses, "eagle3_heldout_top1_by_step": top1,
        "acceptance": {"chain": s.eval_chain, "prompts": len(prompts),
                       "prompt_len": s.eval_prompt_len, "new_tokens": s.eval_new_tokens} | acc,
    }
    if report["checkpoint_bytes"]["total"] > MAX_TOTAL_BYTES:
        log(f"WARNING: checkpoints total {report['checkpoint_bytes']['total']} bytes > 30 MB")
    timings["total"] = time.perf_counter() - t_start
    report["wall_seconds"] = timings | {r.name: r.seconds for r in
                                        (res_target, res_draft, res_eagle)}
    (out / "TRAINING.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"done in {timings['total']:.1f}s → {out}")
    return report


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
