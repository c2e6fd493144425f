"""GraphRAG-R1 rewards: format, Progressive Retrieval Attenuation (PRA) and Cost-Aware F1 (CAF).

Yu et al., "GraphRAG-R1: Graph Retrieval-Augmented Generation with Process-Constrained
Reinforcement Learning", 2025, arXiv:2507.23581 — process-constrained rewards (PRA, CAF) and the
phase-dependent training strategy.

With N the number of retrievals in the trajectory::

    R_format = 0.5 if the trajectory follows the format, else 0
    PRA:  R_N = R0 · (1 − k^N) / (1 − k)     (k ≠ 1)        R0 = 0.5
          R_N = R0 · N                        (k = 1)
    CAF:  R = F1 · a · exp(−b · N)            a = 2, b = 0.1

R0 (the paper's R_0) is the base reward, 0.5: what the first retrieval earns, not the value of
PRA for a trajectory without retrievals. That value, PRA at N = 0, is 0 here: both forms above
give 0 at N = 0 (an empty geometric sum), and the paper does not state the zero-retrieval case
on its own, so 0 is our reading of the formula, not a number the paper gives.

Phases: 1 — SFT cold start (no reward); 2 — R_format + PRA; 3 — R_format + CAF.

PRA is a geometric series: each extra retrieval adds R0·k^(N−1). The paper contradicts itself
on k: its equation section asks for 0 < k < 1 (then the first retrievals earn the most and PRA is
bounded by R0/(1 − k)), while its implementation details report R0 = 0.5 and k = 1. raggym
follows the reported value, **k = 1** (``pra_decay=1.0``), which makes PRA linear, R_N = R0·N:
every retrieval earns R0 and phase 2 can only be capped by the environment's retrieval budget.
``pra_decay`` below 1 gives the bounded form of the equation section (k = 0.5 bounds PRA by 1).

CAF rewards answer quality (token F1 against the gold answers) and discounts it by e^(−bN) per
retrieval (against over-thinking / over-retrieving).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from raggym.rewards.metrics import token_f1
from raggym.rewards.outcome import EpisodeOutcome


@dataclass(frozen=True)
class GraphRAGR1Config:
    format_reward: float = 0.5
    pra_initial: float = 0.5  # R0
    pra_decay: float = 1.0  # k: the paper's reported value (its equation section asks for 0 < k < 1)
    caf_scale: float = 2.0  # a
    caf_decay: float = 0.1  # b


def graphrag_r1_format_reward(format_ok: bool, value: float = 0.5) -> float:
    """R_format = 0.5 if the format checks, else 0."""
    return value if format_ok else 0.0


def progressive_retrieval_attenuation(n_retrievals: int, r0: float = 0.5, k: float = 1.0) -> float:
    """PRA: R_N = R0·(1 − k^N)/(1 − k), or R0·N when k = 1; 0 for N = 0 (the formula's value there,
    our reading: the paper gives no separate zero-retrieval case; R0 is the base reward, 0.5)."""
    if n_retrievals < 0:
        raise ValueError("the number of retrievals cannot be negative")
    if n_retrievals == 0:
        return 0.0
    if k == 1.0:
        return r0 * n_retrievals  # limit of the geometric sum as k → 1
    return r0 * (1.0 - k**n_retrievals) / (1.0 - k)  # R_N = R0 (1 − k^N) / (1 − k)


def cost_aware_f1(f1: float, n_retrievals: int, a: float = 2.0, b: float = 0.1) -> float:
    """CAF: F1 · a · exp(−b·N)."""
    if n_retrievals < 0:
        raise ValueError("the number of retrievals cannot be negative")
    return f1 * a * math.exp(-b * n_retrievals)  # R = F1 · a · e^(−bN)


def graphrag_r1_phase2_reward(
    outcome: EpisodeOutcome, config: GraphRAGR1Config = GraphRAGR1Config()
) -> float:
    """Phase 2: R_format + PRA(N)."""
    pra = progressive_retrieval_attenuation(
        outcome.retrieval_count, config.pra_initial, config.pra_decay
    )
    return graphrag_r1_format_reward(outcome.format_ok, config.format_reward) + pra


def graphrag_r1_phase3_reward(
    outcome: EpisodeOutcome, config: GraphRAGR1Config = GraphRAGR1Config()
) -> float:
    """Phase 3: R_format + CAF(F1, N)."""
    f1 = token_f1(outcome.answer, outcome.gold_answers)
    return graphrag_r1_format_reward(outcome.format_ok, config.format_reward) + cost_aware_f1(
        f1, outcome.retrieval_count, config.caf_scale, config.caf_decay
    )


def graphrag_r1_batch_rewards(
    outcomes: Sequence[EpisodeOutcome], phase: int, config: GraphRAGR1Config = GraphRAGR1Config()
) -> list[float]:
    """GraphRAG-R1 reward for a batch in phase 2 or 3 (phase 1 is supervised, with no reward)."""
    if phase == 2:
        return [graphrag_r1_phase2_reward(o, config) for o in outcomes]
    if phase == 3:
        return [graphrag_r1_phase3_reward(o, config) for o in outcomes]
    if phase == 1:
        raise ValueError("GraphRAG-R1 phase 1 is the SFT cold start; it has no reward")
    raise ValueError(f"GraphRAG-R1 has phases 1, 2 and 3, got {phase!r}")
