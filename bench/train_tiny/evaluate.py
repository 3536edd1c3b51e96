"""Held-out numbers: next-token loss, and greedy speculative acceptance of a chain.

Acceptance, greedy and exact: speculation never changes greedy output, so the target's
plain greedy continuation `cont` of a prompt (full forwards, no KV cache) is the output
of every speculative run. At committed length P+j the proposer drafts `chain` tokens from
cont[:P+j]; a(j) = length of the longest draft prefix equal to cont[P+j:]; the step emits
a(j) + 1 tokens (the accepted ones and the bonus) and the next step starts at
j + a(j) + 1. Mean tokens per step = emitted tokens / steps over all prompts.
Example: chain 4, a = 2, 4, 0 → (3 + 5 + 1) / 3 = 3.0 tokens per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import Qwen3ForCausalLM

from train_tiny.distill import TargetTap
from train_tiny.eagle3 import Eagle3Head
from train_tiny.lm import greedy_continue

# (cont [B, L], m) → drafts [B, chain] proposed from the prefix cont[:, :m]
Proposer = Callable[[torch.Tensor, int], torch.Tensor]


@torch.no_grad()
def heldout_loss(model: Qwen3ForCausalLM, windows: torch.Tensor, device: torch.device,
                 batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over windows [n, L]."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(device)
        logits = model(input_ids=w[:, :-1]).logits.float()
        total += float(F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(),
                                       reduction="sum"))
        count += w[:, 1:].numel()
    return total / count


def accepted_lengths(cont: torch.Tensor, prompt_len: int, new_tokens: int,
                     propose: Proposer, chain: int) -> torch.Tensor:
    """a(j) [B, new_tokens] for every committed length prompt_len + j."""
    out = []
    for j in range(new_tokens):
        m = prompt_len + j
        drafts = propose(cont, m)
        match = (drafts == cont[:, m:m + chain]).long()
        out.append(match.cumprod(-1).sum(-1))
    return torch.stack(out, dim=1).cpu()


def simulate(accepted: torch.Tensor, chain: int) -> dict:
    """Walk each prompt's steps through a(j); see the module docstring."""
    steps, tokens = 0, 0
    hist = [0] * (chain + 1)
    for row in accepted.tolist():
        j = 0
        while j < len(row):
            a = row[j]
            hist[a] += 1
            steps += 1
            tokens += a + 1
            j += a + 1
    return {"mean_tokens_per_step": tokens / max(1, steps), "steps": steps,
            "tokens": tokens, "accepted_histogram": hist,
            "acceptance_at_depth": [sum(hist[k:]) / max(1, steps) for k in range(1, chain + 1)]}


@torch.no_grad()
def acceptance(target: Qwen3ForCausalLM, prompts: torch.Tensor, new_tokens: int,
               chain: int, proposers: dict[str, Proposer],
               device: torch.device) -> dict[str, dict]:
    """Each proposer's greedy acceptance on the target's continuations of prompts [B, P]."""
    prompts = prompts.to(device)
    cont = greedy_continue(target, prompts, new_tokens + chain, use_cache=False)
    return {name: simulate(accepted_lengths(cont, prompts.shape[1], new_tokens, propose, chain),
                           chain)
            for name, propose in proposers.items()}


def draft_proposer(draft: Qwen3ForCausalLM, chain: int) -> Proposer:
    def propose(cont: torch.Tensor, m: int) -> torch.Tensor:
        return greedy_continue(draft, cont[:, :m], chain, use_cache=False)[:, -chain:]
    return propose


class EagleProposer:
    """Target features over the whole continuation, once per continuation (causal, so a
    prefix's features are those of the prefix alone), then `Eagle3Head.draft_chain`."""

    def __init__(self, head: Eagle3Head, tap: TargetTap, chain: int) -> None:
        self.head, self.tap, self.chain = head, tap, chain
        self._cont: torch.Tensor | None = None
        self._feats: torch.Tensor | None = None

    def __call__(self, cont: torch.Tensor, m: int) -> torch.Tensor:
        if self._cont is not cont:
            self._cont, self._feats = cont, self.tap(cont)[1].float()
        return self.head.draft_chain(cont[:, :m], self._feats[:, :m - 1], self.chain)


@torch.no_grad()
def eagle_heldout_top1(head: Eagle3Head, tap: TargetTap, windows: torch.Tensor,
                       steps: int, device: torch.device) -> list[float]:
    """Per TTT step, teacher-forced top-1 agreement of the head with the target's argmax
    over held-out windows (a training diagnostic, not an acceptance rate)."""
    hits, count = torch.zeros(steps), 0
    for i in range(0, len(windows), 16):
        w = windows[i:i + 16].to(device)
        z, feats = tap(w)
        t = w.shape[1] - steps
        logits = head.unrolled(feats[:, :t].float(), w[:, 1:t + steps], steps)
        for k, lg in enumerate(logits):
            agree = head.to_target(lg.argmax(-1)) == z[:, 1 + k:1 + k + t].argmax(-1)
            hits[k] += float(agree.sum())
        count += w.shape[0] * t
    return (hits / count).tolist()
