"""RouteRAG rewards: exact match, then exact match plus a batch-centred efficiency term.

Guo et al., "RouteRAG: Efficient Retrieval-Augmented Generation from Text and Graph via
Reinforcement Learning", 2025, arXiv:2512.09487 — two-stage GRPO training, reward design.

Stage 1 (correctness)::

    R = EM(answer, gold)

Stage 2 (correctness + efficiency), only correct answers earn the efficiency term::

    R = EM + R_eff   if EM = 1,   else 0
    R_eff = (t_avg − t) / T

* ``t`` is the trajectory's total retrieval time: the sum of its own queries' times, each query
  timed alone by the retriever (``RetrieverConfig.timing="per_query"``), so a query's time does
  not depend on the other queries that shared its retrieval call. The paper says only that T
  keeps t in [0, 0.5]; the scaling used here comes from the official RouteRAG code, which divides
  by the batch's 95th percentile:  t = min(0.5, 0.5 · t_raw / p95(batch t_raw)).
* ``t_avg`` is the mean of the scaled times over the **whole batch** (every rollout of every
  prompt, correct or not), not the GRPO group. Centring on the batch lets a prompt whose rollouts
  all retrieve heavily still be pushed toward cheaper strategies.
* ``T`` is a temperature; with the scaled times and ``T = 1`` (the default) R_eff lies in
  [−0.5, 0.5], so a correct answer always scores more than a wrong one.

The time is either measured wall seconds (``time_source="seconds"``, the recipe's choice) or the
retriever's deterministic cost (``time_source="cost"``: work units that depend only on the query
and the index), which makes runs reproducible across machines; docs/benchmarks.md compares the
passage/graph ratio of the two. Because R_eff depends on
the whole batch, stage 2 is a batch transform over episode records and must run before GRPO's
group normalisation (``raggym.algorithms.grpo_advantages``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from raggym.rewards.outcome import EpisodeOutcome

TIME_SOURCES = ("seconds", "cost")


@dataclass(frozen=True)
class RouteRAGConfig:
    time_source: str = "seconds"  # "seconds" (measured) or "cost" (deterministic)
    max_scaled_time: float = 0.5  # scaled times lie in [0, max_scaled_time]
    scale_percentile: float = 95.0  # the batch percentile that maps to max_scaled_time
    temperature: float = 1.0  # T in R_eff = (t_avg − t) / T

    def __post_init__(self):
        if self.time_source not in TIME_SOURCES:
            raise ValueError(
                f"time_source must be one of {', '.join(TIME_SOURCES)}, got {self.time_source!r}"
            )
        if self.temperature <= 0:
            raise ValueError("temperature must be positive")


def retrieval_time(outcome: EpisodeOutcome, time_source: str = "seconds") -> float:
    """The episode's total retrieval time in the configured unit."""
    if time_source == "seconds":
        return outcome.retrieval_seconds
    if time_source == "cost":
        return outcome.retrieval_cost
    raise ValueError(f"time_source must be one of {', '.join(TIME_SOURCES)}, got {time_source!r}")


def scale_retrieval_times(
    raw_times: Sequence[float], max_scaled_time: float = 0.5, percentile: float = 95.0
) -> np.ndarray:
    """t = min(max_scaled, max_scaled · t_raw / p95(batch)); all zeros when p95 is 0."""
    raw = np.asarray(raw_times, dtype=np.float64)
    if raw.size == 0:
        return raw
    if np.any(raw < 0):
        raise ValueError("retrieval times must be non-negative")
    p95 = float(np.percentile(raw, percentile))  # linear interpolation between order statistics
    if p95 <= 0.0:
        return np.zeros_like(raw)
    return np.minimum(max_scaled_time, max_scaled_time * raw / p95)  # t = min(0.5, 0.5·t/p95)


def batch_centered_efficiency(
    raw_times: Sequence[float],
    temperature: float = 1.0,
    max_scaled_time: float = 0.5,
    percentile: float = 95.0,
) -> np.ndarray:
    """R_eff = (t_avg − t) / T for every trajectory of the batch, with t_avg the batch mean."""
    scaled = scale_retrieval_times(raw_times, max_scaled_time, percentile)
    if scaled.size == 0:
        return scaled
    batch_mean = scaled.mean()  # t_avg over the whole batch
    return (batch_mean - scaled) / temperature  # R_eff = (t_avg − t) / T


def routerag_stage1_reward(outcome: EpisodeOutcome) -> float:
    """Stage 1: R = EM (the outcome's cached EM, which the step metrics read too)."""
    return outcome.em


def routerag_stage2_rewards(
    outcomes: Sequence[EpisodeOutcome], config: RouteRAGConfig = RouteRAGConfig()
) -> list[float]:
    """Stage 2 over a whole batch: R = EM + R_eff if EM = 1 else 0."""
    raw = [retrieval_time(o, config.time_source) for o in outcomes]
    efficiency = batch_centered_efficiency(
        raw, config.temperature, config.max_scaled_time, config.scale_percentile
    )
    rewards = []
    for outcome, r_eff in zip(outcomes, efficiency):
        em = outcome.em
        rewards.append(em + float(r_eff) if em == 1.0 else 0.0)  # R = EM + R_eff if EM = 1 else 0
    return rewards


def routerag_batch_rewards(
    outcomes: Sequence[EpisodeOutcome], stage: int, config: RouteRAGConfig = RouteRAGConfig()
) -> list[float]:
    """RouteRAG reward for a batch at the given stage (1 or 2)."""
    if stage == 1:
        return [routerag_stage1_reward(o) for o in outcomes]
    if stage == 2:
        return routerag_stage2_rewards(outcomes, config)
    raise ValueError(f"RouteRAG has stages 1 and 2, got {stage!r}")
