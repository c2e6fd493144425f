"""Rollout correction: importance weights for the gap between the rollout engine and the learner.

The rollout engine samples from π_rollout (vLLM's kernels, often bf16), the learner trains on
π_old, its own log-probs of the same tokens at the same weights. The two differ by kernels and
precision, so the batch is slightly off-policy even at ρ = π_θ/π_old = 1. A correction multiplies
each token's policy-gradient loss by an importance weight of the gap,

    log ρ_t = log π_old(y_t) − log π_rollout(y_t)            (per trained token t)

at one of three granularities (``LEVELS``, a registry):

    token       w_t = ρ_t
    sequence    w_t = Π_s ρ_s = exp(Σ_s log ρ_s)           (over the sequence's trained tokens)
    geometric   w_t = exp(mean_s log ρ_s)                   (the sequence's geometric mean: its scale
                                                             does not grow with the length)

and one of two controls of the large weights (``kind``):

    truncate    w ← min(w, C)                                (every token kept, its weight capped)
    mask        token kept iff lo ≤ w ≤ hi, with its weight w; a rejected token leaves the loss
                and the loss's denominator (the learner drops it from ``loss_mask``)

``C`` = ``threshold`` (2.0 as in ms-swift); ``hi`` = ``threshold`` and ``lo`` = ``lower`` (default
1 / threshold). The weights carry no gradient. ``mismatch_metrics`` gives the diagnostics logged
every step whether or not a correction is on. The tokens were sampled from π_rollout, so both KL
estimators estimate KL(π_rollout ‖ π_old): k1 = E[−log ρ] (unbiased, either sign on one batch) and
k3 = E[ρ − 1 − log ρ] (never negative); the perplexity ratio PPL_old / PPL_rollout per sequence,
averaged over sequences; χ² = E[ρ²] − 1 per token, and per sequence with each sequence's geometric ρ.

Parity (tests/test_rollout_correction.py transcribes the references' formulas): the weights of
``token`` and ``geometric`` are ms-swift's ``token_truncate`` and ``sequence_truncate`` (ms-swift's
sequence ratio is the geometric mean), ``sequence`` is verl's sequence-level product; k1, k3,
the perplexity ratio and χ² per token are verl's ``compute_offpolicy_metrics`` (ms-swift's k1 has
the opposite sign), χ² per sequence is ms-swift's (verl's uses the product). ``mask`` rejects
outside [lo, hi] and drops the token from the denominator, as slime #657 and verl do; ms-swift's
``token_mask`` zeroes the weight and keeps the token in the denominator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

# exp() of a log-weight beyond this overflows float32; the weights are capped or rejected anyway
_MAX_LOG_WEIGHT = 80.0

CorrectionKind = Literal["truncate", "mask"]


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """``learner.loss.rollout_correction``: off when ``level`` is None."""

    level: str | None = None  # token | sequence | geometric (``LEVELS``)
    kind: CorrectionKind = "truncate"
    threshold: float = 2.0  # C of truncate, hi of mask
    lower: float | None = None  # lo of mask; None: 1 / threshold

    def __post_init__(self) -> None:
        if self.level is None:
            return
        if self.level not in LEVELS:
            raise ValueError(f"learner.loss.rollout_correction.level must be one of {sorted(LEVELS)} (or null), "
                             f"got {self.level!r}")
        if self.kind not in ("truncate", "mask"):
            raise ValueError(f"learner.loss.rollout_correction.kind must be 'truncate' or 'mask', got {self.kind!r}")
        if not self.threshold > 0:
            raise ValueError(f"learner.loss.rollout_correction.threshold must be positive, got {self.threshold}")
        if self.kind == "mask" and not 0 <= self.bounds[0] < self.bounds[1]:
            raise ValueError(f"learner.loss.rollout_correction needs 0 <= lower < threshold, got {self.bounds}")

    @property
    def enabled(self) -> bool:
        return self.level is not None

    @property
    def bounds(self) -> tuple[float, float]:
        """(lo, hi) of the mask."""
        lower = 1.0 / self.threshold if self.lower is None else float(self.lower)
        return lower, float(self.threshold)


# ---------------------------------------------------------------------------------------------
# granularity: log ρ per token -> the log-weight each token gets
# ---------------------------------------------------------------------------------------------

LogWeights = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LEVELS: dict[str, LogWeights] = {}


def register_correction_level(name: str) -> Callable[[LogWeights], LogWeights]:
    """Register ``fn(log_ratio [B, T], mask [B, T] bool) -> log-weight [B, T]`` under ``name``."""

    def decorate(fn: LogWeights) -> LogWeights:
        if name in LEVELS:
            raise ValueError(f"rollout-correction level {name!r} is already registered")
        LEVELS[name] = fn
        return fn

    return decorate


def _per_sequence(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.unsqueeze(-1).expand_as(like)


@register_correction_level("token")
def token_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return log_ratio  # log w_t = log ρ_t


@register_correction_level("sequence")
def sequence_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _per_sequence((log_ratio * mask).sum(-1), log_ratio)  # log w = Σ_s log ρ_s


@register_correction_level("geometric")
def geometric_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    tokens = mask.sum(-1).clamp(min=1)
    return _per_sequence((log_ratio * mask).sum(-1) / tokens, log_ratio)  # log w = mean_s log ρ_s


# ---------------------------------------------------------------------------------------------
# the correction and its diagnostics
# ---------------------------------------------------------------------------------------------


@dataclass
class RolloutCorrection:
    """One batch's correction: ``weights`` multiply the PG loss per token (1 off the trained
    tokens), ``keep`` is the loss mask after rejection, ``metrics`` what it did."""

    weights: torch.Tensor  # [B, T] float32, no gradient
    keep: torch.Tensor  # [B, T] bool
    metrics: dict[str, float]


def _trained(mask: torch.Tensor) -> torch.Tensor:
    trained = mask.to(torch.bool).clone()
    trained[:, 0] = False  # nothing predicts the first token
    return trained


@torch.no_grad()
def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                       config: RolloutCorrectionConfig) -> RolloutCorrection:
    """The correction ``config`` asks for (module docstring) over a ``[B, T]`` batch."""
    if not config.enabled:
        raise ValueError("rollout_correction called with the correction off (level null)")
    mask = _trained(loss_mask)
    log_ratio = (old_logprobs.float() - rollout_logprobs.float()) * mask
    log_w = LEVELS[config.level](log_ratio, mask).clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT)
    w = torch.exp(log_w)
    if config.kind == "truncate":
        changed = mask & (w > config.threshold)
        w = w.clamp(max=config.threshold)  # min(w, C)
        keep = mask
    else:
        lo, hi = config.bounds
        inside = (w >= lo) & (w <= hi)
        changed = mask & ~inside
        keep = mask & inside
    weights = torch.where(keep, w, torch.ones_like(w))
    tokens = max(int(mask.sum()), 1)
    kept = weights[keep]
    metrics = {
        "rollout_is/changed_share": float(changed.sum()) / tokens,  # truncated or rejected
        "rollout_is/weight_mean": float(kept.mean()) if kept.numel() else 0.0,
        "rollout_is/weight_max": float(kept.max()) if kept.numel() else 0.0,
    }
    keep = keep | (loss_mask.to(torch.bool) & ~mask)  # position 0 stays as the batch had it
    return RolloutCorrection(weights, keep, metrics)


@torch.no_grad()
def mismatch_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                     loss_mask: torch.Tensor) -> dict[str, float]:
    """How far π_old is from π_rollout on the trained tokens (module docstring), ``rollout_is/*``."""
    mask = _trained(loss_mask)
    if not bool(mask.any()):
        return {}
    gap = old_logprobs.float() - rollout_logprobs.float()
    log_ratio = gap[mask]  # log ρ_t on the trained tokens
    ratio = torch.exp(log_ratio.clamp(max=_MAX_LOG_WEIGHT))
    per_sequence = geometric_log_weights(gap * mask, mask)[:, 0]
    rows = mask.any(-1)
    # log(PPL_old / PPL_rollout) of a sequence = −(its mean log ρ): mean_t log π_rollout − mean_t log π_old
    log_ppl_ratio = -per_sequence[rows]
    return {
        "rollout_is/kl_k1": float(-log_ratio.mean()),  # E_rollout[−log ρ]
        "rollout_is/kl_k3": float((ratio - 1 - log_ratio).mean()),  # E_rollout[ρ − 1 − log ρ]
        "rollout_is/ppl_ratio": float(torch.exp(log_ppl_ratio).mean()),  # mean over sequences of PPL_old / PPL_rollout
        "rollout_is/chi2_token": float((ratio ** 2).mean() - 1),  # E[ρ_t²] − 1
        "rollout_is/chi2_seq": float(torch.exp(2 * per_sequence[rows].clamp(max=_MAX_LOG_WEIGHT / 2)).mean() - 1),
    }


__all__ = [
    "LEVELS",
    "RolloutCorrection",
    "RolloutCorrectionConfig",
    "mismatch_metrics",
    "register_correction_level",
    "rollout_correction",
]
