"""What one ``Learner.update`` reports: seconds per phase, token counts, gradient norms and the loss stats.

Loss stats arrive per micro-batch and per loss group (``raggym.algorithms.policy_loss``), each
weighted like the loss: ``w_g / (K · GA)`` of a micro-batch's stat summed over the mini-batch,
times K, and averaged over the K ranks by ``LearnerGroup``, is the mini-batch value, whatever the
micro-batch split. Mini-batch values are averaged over the update.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

from raggym.algorithms.batch import TrainBatch

PHASES = ("old_logprobs", "reference", "teacher", "forward", "backward", "optimizer", "wait")


class UpdateLog:
    """Accumulates one update's metrics on one rank (``world_size`` K, gradient accumulation GA)."""

    def __init__(self, world_size: int, grad_accum: int):
        self.world_size, self.grad_accum = world_size, grad_accum
        self.started = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.tokens = self.micro_batches = 0
        self.grad_norms: list[float] = []
        self.totals: dict[str, float] = {}  # the loss terms' sums over the update
        self._mini: dict[str, float] = {}
        self._per_mini: list[dict[str, float]] = []

    @contextmanager
    def timer(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    def grad_norm(self, norm: float | None) -> None:
        if norm is not None and math.isfinite(norm):
            self.grad_norms.append(norm)

    def micro_batch(self, micro: TrainBatch, weights: Sequence[float], group_stats: Sequence[Mapping[str, float]],
                    totals: Mapping[str, float]) -> None:
        """Add a (non-filler) micro-batch's tokens, stats (each group's weighted by its weight) and totals."""
        self.tokens += int(micro.attention_mask.sum())
        for weight, stats in zip(weights, group_stats):
            for k, v in stats.items():
                self._mini[k] = self._mini.get(k, 0.0) + v * weight / (self.world_size * self.grad_accum)
        for k, v in totals.items():
            self.totals[k] = self.totals.get(k, 0.0) + v

    def end_mini_batch(self) -> None:
        self._per_mini.append({k: v * self.world_size for k, v in self._mini.items()})
        self._mini = {}

    def metrics(self, tokens_computed: int, tokens_padded: int, **extra: float) -> dict[str, float]:
        """The mini-batch means of the loss stats, ``extra``, and the counts and timings of the update."""
        elapsed = time.perf_counter() - self.started
        per_mini = self._per_mini
        metrics = {k: sum(m[k] for m in per_mini) / len(per_mini) for k in per_mini[0]}
        metrics.update(extra)
        positions = tokens_computed + tokens_padded
        metrics.update(
            grad_norm=sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else float("nan"),
            micro_batches=float(self.micro_batches),  # forward/backward passes (more than n / micro_batch_size under a token budget)
            tokens=float(self.tokens),
            tokens_computed=float(tokens_computed),
            padding_share=tokens_padded / positions if positions else 0.0,
            prompt_share_saved=1.0 - tokens_computed / self.tokens if self.tokens else 0.0,
            update_seconds=elapsed,
            tokens_per_s=self.tokens / elapsed if elapsed > 0 else float("nan"),
            **{f"seconds_{k}": v for k, v in self.seconds.items()},
        )
        return metrics


__all__ = ["PHASES", "UpdateLog"]
