"""The pipeline: corpus → tokenizer → target → draft (distilled) → EAGLE-3 head (TTT) →
held-out evaluation of the saved checkpoints → TRAINING.json. Command: bench/train_tiny.py."""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import transformers
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from train_tiny import corpus as C
from train_tiny import distill as D
from train_tiny import eagle3 as E
from train_tiny import evaluate as V
from train_tiny import lm
from train_tiny.settings import Settings, parse_args
from train_tiny.train_loop import StageResult, run_stage

NAMES = {"target": "tiny-code", "draft": "tiny-code-draft", "eagle3": "tiny-code-eagle3"}
MAX_TOTAL_BYTES = 30 * 1024 * 1024    # these three; with tiny-code-dflash all stay <= 40 MB


def log(msg: str) -> None:
    print(f"[train_tiny] {msg}", flush=True)


@dataclass(frozen=True)
class Data:
    corpus: C.Corpus
    tok: PreTrainedTokenizerFast
    train: torch.Tensor          # training token stream
    held: torch.Tensor           # held-out token stream
    held_windows: torch.Tensor   # [n, seq_len + 1] for held-out losses
    draft_ids: torch.Tensor      # the EAGLE-3 draft vocabulary, ascending target ids
    d2t: torch.Tensor
    t2d: torch.Tensor


@dataclass(frozen=True)
class Run:
    s: Settings
    device: torch.device
    out: Path

    def budget(self, share: float) -> float:
        return 60.0 * self.s.minutes_budget * share

    def path(self, key: str) -> Path:
        return self.out / NAMES[key]


def prepare_data(s: Settings) -> Data:
    corpus = C.load_corpus(s.max_files)
    tok = C.train_tokenizer(corpus.train_texts, s.vocab_size, s.max_position)
    train = C.encode_stream(tok, corpus.train_texts)
    held = C.encode_stream(tok, corpus.held_out_texts)
    ids, d2t, t2d = C.draft_vocab(train, s.vocab_size, s.draft_vocab_size)
    windows = C.fixed_windows(held, s.seq_len + 1, s.loss_eval_windows)
    return Data(corpus, tok, train, held, windows, ids, d2t, t2d)


def _compiled(model: torch.nn.Module, s: Settings):
    return torch.compile(model, dynamic=False) if s.compile else model


def train_target(r: Run, data: Data) -> tuple[Qwen3ForCausalLM, StageResult]:
    """Next-token cross-entropy on real windows; returns the *saved* target, reloaded
    (bf16 values in fp32), which teaches the draft and the head."""
    s, dev = r.s, r.device
    target = lm.new_model(s.target, s, data.tok.eos_token_id, seed=s.seed, device=dev)
    fwd = _compiled(target, s)
    sampler = C.WindowSampler(data.train, s.seq_len + 1, seed=s.seed + 1)
    st = s.target_stage
    res = run_stage("target", list(target.parameters()),
                    lambda _: lm.next_token_loss(fwd, sampler.sample(st.batch).to(dev)),
                    st, r.budget(st.budget_share), dev, s.log_every,
                    lambda: f"loss {V.heldout_loss(target, data.held_windows, dev):.4f}",
                    s.eval_every)
    lm.save_lm(target, data.tok, r.path("target"), s.save_dtype)
    return lm.load_lm(r.path("target"), dev), res


def generation_pool(r: Run, data: Data, target: Qwen3ForCausalLM) -> torch.Tensor | None:
    s = r.s
    if s.gen_seqs <= 0:
        return None
    prompts = C.WindowSampler(data.train, s.gen_prompt_len, seed=s.seed + 2)
    return D.generate_pool(target, prompts, s.gen_seqs, s.gen_len, r.device,
                           batch=2048 if r.device.type == "cuda" else 256)


def train_draft(r: Run, data: Data, target: Qwen3ForCausalLM,
                pool: torch.Tensor | None) -> StageResult:
    s, dev = r.s, r.device
    draft = lm.new_model(s.draft, s, data.tok.eos_token_id, seed=s.seed + 3, device=dev)
    fwd = _compiled(draft, s)
    sd = s.draft_stage
    batches = D.MixedBatches(C.WindowSampler(data.train, s.seq_len, seed=s.seed + 4), pool,
                             s.gen_mix, sd.batch, seed=s.seed + 5)
    res = run_stage("draft", list(draft.parameters()),
                    lambda step: lm.distill_loss(fwd, target, batches(step).to(dev)),
                    sd, r.budget(sd.budget_share), dev, s.log_every,
                    lambda: f"loss {V.heldout_loss(draft, data.held_windows, dev):.4f}",
                    s.eval_every)
    lm.save_lm(draft, data.tok, r.path("draft"), s.save_dtype)
    return res


def train_eagle(r: Run, data: Data, target: Qwen3ForCausalLM, pool: torch.Tensor | None,
                aux_ids: list[int]) -> StageResult:
    s, dev = r.s, r.device
    cfg = E.head_config(target.config, s.eagle_intermediate, s.draft_vocab_size, aux_ids,
                        s.save_dtype)
    head = E.new_head(cfg, target, data.draft_ids, data.d2t, data.t2d, seed=s.seed + 6).to(dev)
    tap = D.TargetTap(target, aux_ids)
    se = s.eagle_stage
    batches = D.MixedBatches(C.WindowSampler(data.train, s.seq_len, seed=s.seed + 7), pool,
                             s.gen_mix, se.batch, seed=s.seed + 8)
    ids = data.draft_ids.to(dev)
    probe = data.held_windows[:16, :s.seq_len]

    def report() -> str:
        top1 = V.eagle_heldout_top1(head, tap, probe, s.ttt_steps, dev)
        return f"top-1 by step {[round(x, 3) for x in top1]}"

    res = run_stage("eagle3", list(head.parameters()),
                    lambda step: D.eagle_loss(head, tap, batches(step).to(dev), s.ttt_steps, ids),
                    se, r.budget(se.budget_share), dev, s.log_every, report, s.eval_every)
    tap.close()
    path = r.path("eagle3")
    E.save_head(head, path, lm.SAVE_DTYPES[s.save_dtype])
    lm.save_tokenizer(data.tok, path)
    eos = data.tok.eos_token_id
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "pad_token_id": eos}, indent=2) + "\n")
    return res


def evaluate_saved(r: Run, data: Data, target: Qwen3ForCausalLM, aux_ids: list[int]) -> dict:
    """Held-out losses, the head's teacher-forced top-1, and greedy chain acceptance of
    the draft and the head, all from the checkpoints as saved."""
    s, dev = r.s, r.device
    draft = lm.load_lm(r.path("draft"), dev)
    head = E.load_head(r.path("eagle3"), device=dev)
    tap = D.TargetTap(target, aux_ids)
    losses = {"target": V.heldout_loss(target, data.held_windows, dev),
              "draft": V.heldout_loss(draft, data.held_windows, dev)}
    top1 = V.eagle_heldout_top1(head, tap, data.held_windows[:, :s.seq_len], s.ttt_steps, dev)
    prompts = C.fixed_windows(data.held, s.eval_prompt_len, s.eval_prompts)
    acc = V.acceptance(target, prompts, s.eval_new_tokens, s.eval_chain,
                       {"draft": V.draft_proposer(draft, s.eval_chain),
                        "eagle3": V.EagleProposer(head, tap, s.eval_chain)}, dev)
    tap.close()
    for name, a in acc.items():
        log(f"held-out greedy chain-{s.eval_chain} {name}: "
            f"{a['mean_tokens_per_step']:.3f} tokens/step over {a['steps']} steps, "
            f"acceptance by depth {[round(x, 3) for x in a['acceptance_at_depth']]}")
    log(f"held-out loss target {losses['target']:.4f} draft {losses['draft']:.4f}; "
        f"eagle3 teacher-forced top-1 by step {[round(x, 3) for x in top1]}")
    n_head = {k: v.numel() for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    return {
        "params": {"target": lm.num_params(target), "draft": lm.num_params(draft),
                   "eagle3_total": sum(n_head.values()),
                   "eagle3_without_embed": sum(n_head.values()) - n_head["embed_tokens.weight"]},
        "held_out_loss": losses, "eagle3_heldout_top1_by_step": top1,
        "acceptance": {"chain": s.eval_chain, "prompts": len(prompts),
                       "prompt_len": s.eval_prompt_len, "new_tokens": s.eval_new_tokens} | acc}


def run(s: Settings) -> dict:
    t_start = time.perf_counter()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if s.only == "dflash":
        from train_tiny.dflash_stage import run_dflash
        return run_dflash(s)
    r = Run(s, torch.device(s.device), Path(s.out))
    r.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(s.seed)
    if r.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    timings: dict[str, float] = {}

    def timed(name: str, fn, *args):
        t0 = time.perf_counter()
        value = fn(*args)
        timings[name] = time.perf_counter() - t0
        return value

    data = timed("corpus_and_tokenizer", prepare_data, s)
    stats = data.corpus.stats() | {
        "train_tokens": len(data.train), "held_out_tokens": len(data.held),
        "tokenizer_vocab": len(data.tok), "tokenizer_sha256_16": C.tokenizer_digest(data.tok),
        "draft_vocab_coverage": float(data.t2d[data.train].float().mean())}
    log(f"corpus {stats['train_files']} train files ({stats['train_tokens']} tokens), "
        f"{stats['held_out_files']} held out ({stats['held_out_tokens']} tokens), "
        f"tokenizer {len(data.tok)} tokens, {timings['corpus_and_tokenizer']:.1f}s")

    target, res_target = train_target(r, data)
    pool = timed("generate_pool", generation_pool, r, data, target)
    log(f"generated {0 if pool is None else len(pool)} target continuations "
        f"in {timings['generate_pool']:.1f}s")
    res_draft = train_draft(r, data, target, pool)
    aux_ids = E.aux_layer_ids(s.target.layers)
    res_eagle = train_eagle(r, data, target, pool, aux_ids)
    results = timed("evaluate", evaluate_saved, r, data, target, aux_ids)

    stages = (res_target, res_draft, res_eagle)
    sizes = {n: (r.path(n) / "model.safetensors").stat().st_size for n in NAMES}
    report = {
        "settings": s.as_json(),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__,
                        "tokenizers": tokenizers.__version__,
                        "device": (torch.cuda.get_device_name(r.device)
                                   if r.device.type == "cuda" else "cpu")},
        "corpus": stats, "held_out_files": list(data.corpus.held_out_files),
        "train_files": list(data.corpus.train_files), "checkpoints": dict(NAMES),
        "checkpoint_bytes": sizes | {"total": sum(sizes.values())},
        "eagle3": {"aux_layer_ids": aux_ids,
                   "aux_convention": "capture-before: id i = residual stream entering target "
                                     "decoder layer i (= HF output_hidden_states[i])",
                   "ttt_steps": s.ttt_steps, "draft_vocab_size": s.draft_vocab_size},
        "stages": {x.name: x.as_json() for x in stages},
        "final_train_loss": {"target": res_target.final_loss, "draft_kl": res_draft.final_loss,
                             "eagle3_ttt": res_eagle.final_loss},
    } | results
    if report["checkpoint_bytes"]["total"] > MAX_TOTAL_BYTES:
        log(f"WARNING: checkpoints total {report['checkpoint_bytes']['total']} bytes > 30 MiB")
    timings["total"] = time.perf_counter() - t_start
    report["wall_seconds"] = timings | {x.name: x.seconds for x in stages}
    (r.out / "TRAINING.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"done in {timings['total']:.1f}s → {r.out}")
    return report


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
