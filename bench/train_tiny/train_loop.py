"""One optimisation stage: AdamW, warmup + cosine, bf16 autocast on CUDA, a time budget.
A SIGTERM (``timeout``'s) ends the stage after its current step, and any later stage at
once, so what was trained is still saved (a device call's limit otherwise loses the
whole run)."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from train_tiny.settings import StageSettings

_MEASURE_FROM, _MEASURE_TO = 5, 25  # steps timed to project the stage's wall time
_TERM: list[int] = []               # SIGTERMs received while a stage ran


@dataclass(frozen=True)
class StageResult:
    name: str
    steps_planned: int
    steps_run: int
    seconds: float
    final_loss: float       # mean loss over the last logging window
    shrunk_to_budget: bool

    def as_json(self) -> dict:
        return self.__dict__.copy()


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_optimizer(params: Iterable[torch.nn.Parameter], lr: float,
                   device: torch.device) -> torch.optim.AdamW:
    """Weight decay 0.1 on matrices (embeddings included), none on norm vectors."""
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")


def lr_at(step: int, total: int, stage: StageSettings) -> float:
    if step < stage.warmup:
        return stage.lr * (step + 1) / stage.warmup
    progress = min(1.0, (step - stage.warmup) / max(1, total - stage.warmup))
    return stage.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def run_stage(name: str, params: list[torch.nn.Parameter],
              loss_fn: Callable[[int], torch.Tensor], stage: StageSettings,
              budget_s: float, device: torch.device, log_every: int,
              evaluate: Callable[[], str] | None = None, eval_every: int = 0) -> StageResult:
    """Calls loss_fn(step) (which draws its own batch) for stage.steps steps. After a few
    timed steps, if the projection exceeds budget_s the step count shrinks so the whole
    schedule (warmup, cosine) still completes inside the budget. evaluate() (a short
    report) runs every eval_every steps and at the end."""
    opt = make_optimizer(params, stage.lr, device)
    trainable = [p for p in params if p.requires_grad]
    total, shrunk = stage.steps, False
    window_sum, window_n, last_mean = torch.zeros((), device=device), 0, float("nan")
    t0 = time.perf_counter()
    t_measure = t0
    step = 0
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, lambda sig, _: _TERM.append(sig)) if main else None
    while step < total and not _TERM:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, stage)
        with autocast(device):
            loss = loss_fn(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window_sum += loss.detach().float()
        window_n += 1
        step += 1
        if step == _MEASURE_FROM:
            _sync(device)
            t_measure = time.perf_counter()
        if step == _MEASURE_TO and total > _MEASURE_TO:
            _sync(device)
            now = time.perf_counter()
            per_step = (now - t_measure) / (_MEASURE_TO - _MEASURE_FROM)
            fit = _MEASURE_TO + int((budget_s - (now - t0)) / per_step)
            print(f"[{name}] {per_step * 1e3:.1f} ms/step, {total} steps fit "
                  f"{budget_s:.0f} s: {fit >= total}", flush=True)
            if fit < total:
                total, shrunk = max(fit, _MEASURE_TO), True
                print(f"[{name}] shrinking to {total} steps", flush=True)
        if step % log_every == 0 or step == total:
            last_mean = float(window_sum) / window_n
            window_sum.zero_()
            window_n = 0
            print(f"[{name}] step {step}/{total} loss {last_mean:.4f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} {time.perf_counter() - t0:.1f}s", flush=True)
            if time.perf_counter() - t0 > 1.25 * budget_s and step < total:
                print(f"[{name}] over budget, stopping at step {step}", flush=True)
                shrunk = True
                break
        if evaluate is not None and (step == total or (eval_every and step % eval_every == 0)):
            with torch.no_grad():
                print(f"[{name}] step {step} held-out {evaluate()}", flush=True)
    if main:
        signal.signal(signal.SIGTERM, before)
    if _TERM:
        print(f"[{name}] SIGTERM: stopping at step {step}", flush=True)
        last_mean = float(window_sum) / window_n if window_n else last_mean
    _sync(device)
    return StageResult(name, stage.steps, step, time.perf_counter() - t0, last_mean,
                       shrunk or bool(_TERM))
