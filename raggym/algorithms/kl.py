"""Per-token KL estimators between the policy and a frozen reference (Schulman, "Approximating
KL Divergence", 2020), as used by GRPO's KL term and by KL reward penalties.

With tokens sampled from the policy π and ``log_ratio = log π(y_t) − log π_ref(y_t)``:

    k1 = log_ratio                                   unbiased, high variance, can be negative
    abs = |log_ratio|                                biased, ≥ 0 (verl's ``abs``)
    k2 = ½ · log_ratio²                              biased, low variance, ≥ 0
    k3 = exp(−log_ratio) − 1 + log_ratio             unbiased, low variance, ≥ 0
       = π_ref/π − log(π_ref/π) − 1                 ("low_var_kl"; GRPO, DeepSeekMath eq. 4)

``k3`` is computed as ``expm1(x) − x`` with ``x = log π_ref − log π``: expm1 keeps precision for
small ``x``, and since rounding is monotone and ``expm1(x) ≥ x`` exactly, the result is never
negative in floating point either. As in verl, ``x`` is clamped to ±20 before exponentiating and
the estimate is clamped above at ``max_value`` (10) so one badly off-policy token cannot
dominate the loss.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
_ALIASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def canonical_kl_kind(kind: str) -> str:
    try:
        return _ALIASES[kind]
    except KeyError:
        raise ValueError(
            f"unknown KL estimator {kind!r}; expected one of {', '.join(sorted(_ALIASES))}"
        ) from None


def kl_estimate(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kind: str = "low_var_kl",
    max_value: float = 10.0,
) -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs (``[batch, seq]``)."""
    kind = canonical_kl_kind(kind)
    log_ratio = log_probs - ref_log_probs  # log π − log π_ref
    if kind == "k1":
        return log_ratio  # k1 = log(π/π_ref)
    if kind == "abs":
        return log_ratio.abs()  # |log(π/π_ref)|
    if kind == "k2":
        return 0.5 * log_ratio.square()  # k2 = ½ log²(π/π_ref)
    x = (-log_ratio).clamp(min=-20.0, max=20.0)  # x = log(π_ref/π)
    return (torch.expm1(x) - x).clamp(max=max_value)  # k3 = e^x − 1 − x
