"""Where one update's π_old comes from, and how far the rollout engine's log-probs drift from the learner's.

``LearnerConfig.old_logprobs`` (when the batch brings no ``old_logprobs``):

- ``"recompute"``: a no-grad pass over the batch before the first update.
- ``"rollout"``: no such pass. Until the first optimizer step the weights are the rollout's, so
  the first mini-batch takes π_old from its own training forward (exactly what the pass would
  compute: the ratio is 1); later mini-batches and epochs use the rollout's sampled log-probs.
  The drift between those and the learner's own values is measured on the first mini-batch; if
  its mean exceeds ``max_logprob_drift`` on any rank (or the batch has no sampled log-probs and
  more than one optimizer step follows), the learner recomputes π_old for the whole batch before
  the first optimizer step, the last moment a recomputation is exact.

``OldLogprobs`` keeps that state for one ``Learner.update``; the learner runs the passes.
"""

from __future__ import annotations

import torch

from raggym.algorithms.batch import TrainBatch
from raggym.algorithms.rollout_correction import mismatch_metrics


def logprob_drift(sampled: torch.Tensor | None, recomputed: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |log π_rollout − log π_learner| over trained tokens (verl's rollout-probs diff),
    and the mismatch diagnostics of ``raggym.algorithms.rollout_correction.mismatch_metrics``.

    The engine sampled with the same weights the learner recomputes with, so any gap is numerical
    (kernels, dtype, batching) or a bug (stale weights, misaligned tokens); it is logged every step.
    """
    if sampled is None:
        return {}
    mask = loss_mask.to(torch.bool)
    if not bool(mask.any()):
        return {"logprob_drift_mean": 0.0, "logprob_drift_max": 0.0, "logprob_drift_tokens": 0.0}
    gap = (sampled.to(torch.float32) - recomputed.to(torch.float32)).abs()[mask]
    return {"logprob_drift_mean": float(gap.mean()), "logprob_drift_max": float(gap.max()),
            "logprob_drift_tokens": float(mask.sum()),
            **mismatch_metrics(recomputed, sampled, loss_mask)}  # KL, perplexity ratio, χ² (rollout_is/*)


class OldLogprobs:
    """π_old's source in one update (module docstring), the drift it measured, and whether it recomputed.

    ``own``: the first mini-batch takes π_old from its own forward; ``single_update``: that
    mini-batch is the update's only optimizer step, so nothing later needs π_old at all.
    """

    def __init__(self, batch: TrainBatch, old_logprobs: str, single_update: bool):
        sampled, batch.sampled_logprobs = batch.sampled_logprobs, None
        self.own = batch.old_logprobs is None and old_logprobs == "rollout" and (single_update or sampled is not None)
        self.single_update = single_update
        self.needs_pass = batch.old_logprobs is None and not self.own  # recompute before the update
        self.recomputed = False
        self.drift: dict[str, float] = {}
        self.checking = False  # in the first mini-batch of an ``own`` update
        self._checked: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.sampled = sampled
        if self.own and sampled is not None:
            batch.sampled_logprobs = sampled  # travels with the first mini-batch's rows for the drift check

    def measure(self, batch: TrainBatch) -> None:
        """The drift of the sampled log-probs from π_old when π_old is known before the update."""
        if not self.own:
            self.drift = logprob_drift(self.sampled, batch.old_logprobs, batch.loss_mask)

    def start_mini_batch(self, mini: TrainBatch) -> None:
        self.checking = self.own and mini.old_logprobs is None
        self._checked = []

    def observe(self, micro: TrainBatch, current: torch.Tensor, filler: bool) -> None:
        """Keep a micro-batch's own log-probs, while they can still stand in for π_old."""
        if self.checking and micro.sampled_logprobs is not None and not filler:
            self._checked.append((micro.sampled_logprobs, current.cpu(), micro.loss_mask))

    def decides_now(self, boundary: bool) -> bool:
        """At the first optimizer step of an update with more to come: keep the rollout's π_old or recompute?"""
        return boundary and self.checking and not self.single_update

    def checked_drift(self) -> dict[str, float]:
        self.drift = logprob_drift(*(torch.cat(x) for x in zip(*self._checked)))
        return self.drift

    def end_mini_batch(self) -> None:
        if self.checking and self.single_update and self._checked:
            self.checked_drift()


__all__ = ["OldLogprobs", "logprob_drift"]
