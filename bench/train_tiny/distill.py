"""What the draft and the EAGLE-3 head learn from: the target's logits and aux hidden
states, on real windows and on the target's own greedy continuations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Qwen3ForCausalLM

from train_tiny.corpus import WindowSampler
from train_tiny.eagle3 import Eagle3Head
from train_tiny.lm import greedy_continue


class TargetTap:
    """Runs the target and returns (logits [B, W, V], feats [B, W, 3H]) where feats
    concatenates, in ascending order, the residual stream entering each aux layer."""

    def __init__(self, target: Qwen3ForCausalLM, layer_ids: list[int]) -> None:
        self.target, self.layer_ids = target, list(layer_ids)
        self._seen: dict[int, torch.Tensor] = {}
        self._handles = [target.model.layers[i].register_forward_pre_hook(self._hook(i),
                                                                          with_kwargs=True)
                         for i in self.layer_ids]

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, i: int):
        def grab(_module, args, kwargs):
            self._seen[i] = args[0] if args else kwargs["hidden_states"]
        return grab

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, logits: bool = True
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """logits=False: the features alone (the LM head over every position skipped)."""
        self._seen.clear()
        out = self.target(input_ids=ids).logits if logits else self.target.model(input_ids=ids)
        feats = torch.cat([self._seen[i] for i in self.layer_ids], dim=-1)
        self._seen.clear()
        return out if logits else None, feats


def eagle_loss(head: Eagle3Head, tap: TargetTap, batch: torch.Tensor, steps: int,
               draft_ids: torch.Tensor, decay: float = 0.8) -> torch.Tensor:
    """TTT loss on windows batch [B, W]: step k at column t (t < W - steps) is scored by
    soft cross-entropy against the target's next-token distribution at position t+1+k,
    restricted to the draft vocabulary; columns whose target argmax lies outside the draft
    vocabulary are skipped. Step weights decay**k, normalised."""
    z, feats = tap(batch)
    t = batch.shape[1] - steps
    logits = head.unrolled(feats[:, :t], batch[:, 1:t + steps], steps)
    total, weight = 0.0, 0.0
    for k, lg in enumerate(logits):
        zk = z[:, 1 + k:1 + k + t].float()
        p = F.softmax(zk[..., draft_ids], dim=-1)
        valid = head.t2d[zk.argmax(-1)].float()
        ce = -(p * F.log_softmax(lg, dim=-1)).sum(-1)
        total = total + decay ** k * (ce * valid).sum() / valid.sum().clamp(min=1.0)
        weight += decay ** k
    return total / weight


@torch.no_grad()
def generate_pool(target: Qwen3ForCausalLM, sampler: WindowSampler, count: int,
                  new_tokens: int, device: torch.device, batch: int = 512) -> torch.Tensor:
    """count sequences [count, prompt + new_tokens]: real prompts (the sampler's window
    length) followed by the target's greedy continuation, on CPU."""
    out = []
    for start in range(0, count, batch):
        prompts = sampler.sample(min(batch, count - start)).to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16,
                            enabled=device.type == "cuda"):
            out.append(greedy_continue(target, prompts, new_tokens).cpu())
    return torch.cat(out)


class MixedBatches:
    """Per step either real windows [batch, length] or generated sequences (batch scaled to
    keep tokens per step); a share `mix` of steps, spread evenly, is generated."""

    def __init__(self, real: WindowSampler, pool: torch.Tensor | None, mix: float,
                 batch: int, seed: int) -> None:
        self.real, self.pool, self.batch = real, pool, batch
        self.mix = mix if pool is not None and len(pool) else 0.0
        self.gen = torch.Generator().manual_seed(seed)
        if self.mix:
            self.pool_batch = max(1, min(len(pool), batch * real.length // pool.shape[1]))

    def generated(self, step: int) -> bool:
        """Whether step's batch comes from the generated pool."""
        return int((step + 1) * self.mix) > int(step * self.mix)

    def __call__(self, step: int) -> torch.Tensor:
        if self.generated(step):
            idx = torch.randint(0, len(self.pool), (self.pool_batch,), generator=self.gen)
            return self.pool[idx]
        return self.real.sample(self.batch)
