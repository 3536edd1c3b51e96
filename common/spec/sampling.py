"""Sampling: a request's parameters, the target's distribution under them, and the draw.

A request samples from the target's next-token distribution p under its parameters,
defined as transformers' logits warpers define it, applied in this order:
temperature (logits / T), top-k (the k most likely), top-p (the most likely tokens
until their mass reaches top_p, at least one), min-p (tokens at least min_p times as
likely as the most likely). Temperature 0 is greedy (argmax, no sampling).

The draw is Gumbel-max: x = argmax_v(filtered logits / T + g_v), g_v Gumbel noise from
``treespec.kernels.reference.gumbel_noise(seed, position)``: a counter-based hash of the
request's seed, the token's position in the sequence and the vocabulary id. Given the
prefix, the noise at a position is independent of everything before it, so x is an
exact sample of p there; and a position's draw depends only on (seed, position, p), so
with or without speculation, and whatever a drafter proposed, the same seed gives the
same tokens ("coupled" acceptance: a draft token is accepted iff it equals the
target's draw at its node).

Example: logits [2, 1, 0, -5], T 1, top_k 2 -> p over {0, 1} = [0.73, 0.27]; a seed
whose noise at this position is [0.1, 1.5, 3.0, 9.9] draws argmax([2.1, 2.5, -inf,
-inf]) = 1.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from treespec.common.serving.errors import InvalidRequest
from treespec.common.spec.vocab_top import scaled_top
from treespec.kernels.availability import triton_available
from treespec.kernels.noise import gumbel_noise


# The largest temperature a request may set: logits / 100 leave any model's next-token
# distribution close to uniform over the filtered tokens; a larger value is a mistake.
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0        # 0 = greedy; at most MAX_TEMPERATURE
    top_k: int = 0                  # 0 = all tokens
    top_p: float = 1.0              # in (0, 1]
    min_p: float = 0.0              # in [0, 1]
    seed: int = 0                   # the draw's key (0..2^31-1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature <= MAX_TEMPERATURE:     # NaN and inf too
            raise InvalidRequest(f"temperature must be >= 0 and <= {MAX_TEMPERATURE:g}, "
                                 f"got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")


GREEDY = SamplingParams()
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")


def checkpoint_defaults(generation_config: dict) -> dict:
    """The sampling fields a checkpoint's generation_config.json sets (as vLLM reads
    them), e.g. Qwen3's {temperature: 0.6, top_k: 20, top_p: 0.95}."""
    return {f: generation_config[f] for f in SAMPLING_FIELDS
            if generation_config.get(f) is not None}


def resolve(given: dict, defaults: dict) -> SamplingParams:
    """The request's parameters: what it set, else the defaults; a seed when it set
    none (random: two unseeded requests draw independently). InvalidRequest names a
    field that is out of range."""
    vals = {**defaults, **given}
    if "seed" not in vals:
        vals["seed"] = secrets.randbelow(1 << 31)
    vals["seed"] %= 1 << 31
    names = {f.name for f in fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in vals.items() if k in names})


# A batch whose drawing rows all have 0 < top_k <= TOPK_FIRST (Qwen3's default is 20)
# filters the TOPK_FIRST largest logits of a row instead of sorting the vocabulary:
# the same tokens survive, at a fraction of the cost.
TOPK_FIRST = 64


def filter_width(params: list[SamplingParams] | None) -> int:
    """How a step draws for these rows: 0 no row draws, TOPK_FIRST every drawing row
    has 0 < top_k <= TOPK_FIRST, -1 the whole vocabulary is sorted."""
    drawing = [p for p in params or () if not p.greedy]
    if not drawing:
        return 0
    return TOPK_FIRST if all(0 < p.top_k <= TOPK_FIRST for p in drawing) else -1


def filter_sparse(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, width: int = -1
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] float32 and per-row parameters [R] -> (values, ids) [R, W]: the
    row's W likeliest tokens' logits / T, those outside top-k, top-p and min-p at
    -inf (rows with T 0 unscaled; the caller takes their argmax). W = width when
    0 < width < V (every drawing row's top_k <= width: a top-``width`` selection),
    else V (one sort a row). Fixed shapes, no host sync."""
    v = logits.shape[-1]
    x = logits / torch.where(temperature > 0, temperature, 1.0).unsqueeze(-1)
    if 0 < width < v:
        sorted_x, order = x.topk(width, -1)
    else:
        sorted_x, order = x.sort(-1, descending=True)
    rank = torch.arange(sorted_x.shape[-1], device=x.device)
    keep = (top_k.unsqueeze(-1) <= 0) | (rank < top_k.unsqueeze(-1))            # top-k
    probs = torch.softmax(torch.where(keep, sorted_x, float("-inf")), -1)
    before = probs.cumsum(-1) - probs                   # mass of the tokens ranked above
    keep &= (before < top_p.unsqueeze(-1)) | (rank == 0)                         # top-p
    keep &= sorted_x - sorted_x[:, :1] >= torch.log(min_p).unsqueeze(-1)         # min-p
    return torch.where(keep, sorted_x, -math.inf), order


def draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
         top_p: torch.Tensor, min_p: torch.Tensor, seed: torch.Tensor,
         position: torch.Tensor, width: int = -1) -> torch.Tensor:
    """The token each row draws [R] int64 (the argmax where T is 0). logits [R, V]
    (any float dtype), parameters [R], seed [R] and position [R] (the index in its
    sequence of the token being drawn) int64; width: as for filter_sparse. The noise
    is only computed for the W candidates: a token's noise depends on its id alone,
    so the draw is the one over the whole vocabulary."""
    return filter_draw(logits, temperature, top_k, top_p, min_p, seed, position, width)[2]


def filter_draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, min_p: torch.Tensor, seed: torch.Tensor,
                position: torch.Tensor, width: int = -1
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """filter_sparse's (values, ids) [R, W] and draw's tokens [R], of the same logits.
    On a GPU with Triton a top-W batch is filtered and drawn in one kernel
    (kernels/triton_candidates.py; this is its reference)."""
    top = _top_on_device(logits, temperature, width)
    if top is not None:
        from treespec.kernels.triton_candidates import filter_draw as on_device
        vals, ids, tok = on_device(*top[:2], temperature, top_k, top_p, min_p, seed, position)
        return vals, ids, torch.where(temperature > 0, tok, logits.argmax(-1))
    vals, ids = filter_sparse(logits.float(), temperature, top_k, top_p, min_p, width)
    pick = (vals + gumbel_noise(seed, position, ids)).argmax(-1, keepdim=True)
    return vals, ids, torch.where(temperature > 0, ids.gather(-1, pick).squeeze(-1),
                                  logits.argmax(-1))


def _top_on_device(logits: torch.Tensor, temperature: torch.Tensor, width: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(logits / T)'s top-W values and columns [R, W] (T 1 where 0) and the logits'
    log-sum-exp [R] (treespec.common.spec.vocab_top.scaled_top), when the rest is for a Triton
    kernel: a GPU, 0 < W <= treespec.kernels.triton_candidates.MAX_WIDTH."""
    if not (0 < width < logits.shape[-1] and triton_available(logits.device)):
        return None
    from treespec.kernels.triton_candidates import MAX_WIDTH
    if width > MAX_WIDTH:
        return None
    from treespec.kernels import triton_backend
    return scaled_top(logits, temperature, width, triton_backend)


# A drafter's q under rejection sampling: its filtered distribution's DRAFT_Q likeliest
# tokens, renormalized (sparse, so exact: the draft draws from exactly this q).
DRAFT_Q = 32


def draft_scores(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor, seed: torch.Tensor,
                 position: torch.Tensor, rejection: torch.Tensor,
                 ids: torch.Tensor | None = None, width: int = -1
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor]:
    """How a drafter scores and picks the children of rows [R] with logits [R, V],
    over each row's W likeliest columns (its only candidates): (log-probs, picks,
    columns) [R, W] and the sparse q (ids, probs) [R, DRAFT_Q].

    A greedy row's log-probs and picks are its log-softmax. A sampling row's log-probs
    are those of its filtered distribution and its picks those plus the Gumbel noise
    of (seed, position): the largest picks are a draw without replacement whose first
    is the very token ``draw`` takes from the same logits and key (coupled acceptance:
    the draft proposes what the target draws wherever their distributions agree). A
    rejection row (rejection [R] bool) draws the same way from q, its filtered
    distribution cut to the DRAFT_Q likeliest tokens, and gets q back (other rows'
    q is zeros). ids [V]: the target's ids of the logits' columns (a drafter with a
    vocabulary of its own); q's ids are target ids. width: as for filter_sparse (W;
    the result is the draw over the whole vocabulary, since a token outside the top
    W is filtered out). On a GPU with Triton, a top-W batch is scored in one kernel
    (kernels/triton_candidates.py; this is its reference)."""
    top = _top_on_device(logits, temperature, width)
    if top is not None:
        from treespec.kernels.triton_candidates import score_candidates
        return score_candidates(*top, temperature, top_k, top_p, min_p, seed, position,
                                rejection, min(DRAFT_Q, width), ids)
    vals, cols = filter_sparse(logits.float(), temperature, top_k, top_p, min_p, width)
    kept = vals.log_softmax(-1)                              # [R, W], sorted descending
    w, q = kept.shape[-1], min(DRAFT_Q, kept.shape[-1])
    top = kept[:, :q] - kept[:, :q].logsumexp(-1, keepdim=True)          # q: the first Q
    sampled = (temperature > 0).unsqueeze(-1)
    rej = rejection.unsqueeze(-1) & sampled
    base = torch.where(rej, F.pad(top, (0, w - q), value=float("-inf")), kept)
    tid = cols if ids is None else ids[cols]                    # target ids of the W
    pick = base + gumbel_noise(seed, position, tid)
    lp = logits.float().log_softmax(-1).gather(-1, cols)       # a greedy row's, by column
    q_ids = tid[:, :q].to(torch.int32)
    return (torch.where(sampled, base, lp), torch.where(sampled, pick, lp), cols,
            torch.where(rej, q_ids, 0), torch.where(rej, top.exp(), 0.0))


def as_tensors(params: list[SamplingParams], device: torch.device) -> list[torch.Tensor]:
    """[temperature, top_k, top_p, min_p, seed] of the rows, each [R] on device."""
    cols = list(zip(*[(p.temperature, p.top_k, p.top_p, p.min_p, p.seed) for p in params]))
    dtypes = (torch.float32, torch.int64, torch.float32, torch.float32, torch.int64)
    return [torch.tensor(c, dtype=d, device=device) for c, d in zip(cols, dtypes)]
