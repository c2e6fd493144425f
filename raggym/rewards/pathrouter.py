"""PathRouter reward: answer F1 plus evidence overlap plus shaping, and the trajectory route.

Wang et al., "PathRouter: Aligning Rewards with Retrieval Quality in Agentic Graph
Retrieval-Augmented Generation", 2026, arXiv:2606.16409 — path-aware reward and routing.

Reward::

    R   = F1 + 0.5 · EO + r_s
    EO  = mean_{d ∈ gold passages} F1(concat(all retrieved text), d)
    r_s = + 0.2   correct (F1 ≥ 0.5) and ≥ 2 retrievals           (multi-turn bonus)
          − 0.25  answered after ≤ 1 retrieval and EO < θ_P          (lazy single turn)
          − 0.5   truncated (turn limit) without an answer            (timeout)
          − 0.1   per retrieval that returned only passages already seen (redundant retrieval)

The paper states these shaping terms loosely; the exact conditions used here are:

* *correct* is ``EM > 0 or F1 ≥ 0.5`` (the same C as the route; EM = 1 implies F1 = 1, so this is
  F1 ≥ 0.5 in practice).
* *lazy* needs the episode to have **stopped by answering** (an answer is present and the episode
  was not truncated) with at most ``lazy_max_retrievals`` (1) retrievals and EO < θ_P (0.1). It
  applies whether or not the answer is correct: the point is not trusting one shallow lookup.
* *timeout* needs ``truncated`` and no answer.
* *redundant*: a retrieval is redundant when it returned at least one passage and every passage
  it returned had already been returned earlier in the episode (passage ids; texts when the ids
  were not recorded). An empty result is not counted.
* Terms add up; several can fire in one episode.

Route (used by ``raggym.algorithms.route_conditioned_advantages``)::

    C = [EM > 0 or F1 ≥ 0.5],  P = [EO ≥ θ_P]
    C↑P↑ → 1.0,  C↑P↓ → 0.5,  C↓P↑ → 0.3,  C↓P↓ → 1.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from raggym.algorithms.advantages import Route
from raggym.rewards.outcome import EpisodeOutcome


@dataclass(frozen=True)
class PathRouterConfig:
    evidence_weight: float = 0.5  # coefficient of EO in R
    correct_f1_threshold: float = 0.5  # C = [EM > 0 or F1 ≥ this]
    evidence_threshold: float = 0.1  # θ_P: P = [EO ≥ θ_P]
    multi_turn_bonus: float = 0.2
    multi_turn_min_retrievals: int = 2
    lazy_penalty: float = -0.25
    lazy_max_retrievals: int = 1
    timeout_penalty: float = -0.5
    redundant_penalty: float = -0.1  # per redundant retrieval
    # no route weights: they weigh advantages, not rewards (advantage.route_weights)


def is_correct(em: float, f1: float, f1_threshold: float = 0.5) -> bool:
    """C = [EM > 0 or F1 ≥ threshold]."""
    return em > 0 or f1 >= f1_threshold


def count_redundant_retrievals(
    retrieved_ids: Sequence[Sequence[str]], retrieved_texts: Sequence[Sequence[str]] = ()
) -> int:
    """Retrievals whose non-empty result was entirely already seen earlier in the episode."""
    per_call = retrieved_ids if any(retrieved_ids) else retrieved_texts
    seen: set[str] = set()
    redundant = 0
    for result in per_call:
        keys = set(result)
        if keys and keys <= seen:
            redundant += 1
        seen |= keys
    return redundant


def pathrouter_reward_terms(
    outcome: EpisodeOutcome, config: PathRouterConfig = PathRouterConfig()
) -> dict[str, float]:
    """Every term of the PathRouter reward, plus ``total``; useful for logging."""
    em, f1, eo = outcome.em, outcome.f1, outcome.evidence_overlap
    n_retrievals = outcome.retrieval_count
    correct = is_correct(em, f1, config.correct_f1_threshold)
    answered = outcome.answer is not None and not outcome.truncated

    searched_enough = n_retrievals >= config.multi_turn_min_retrievals
    multi_turn = config.multi_turn_bonus if correct and searched_enough else 0.0
    shallow = n_retrievals <= config.lazy_max_retrievals and eo < config.evidence_threshold
    lazy = config.lazy_penalty if answered and shallow else 0.0
    timeout = config.timeout_penalty if outcome.truncated and outcome.answer is None else 0.0
    redundant = config.redundant_penalty * count_redundant_retrievals(
        outcome.retrieved_ids, outcome.retrieved_texts
    )
    shaping = multi_turn + lazy + timeout + redundant  # r_s
    total = f1 + config.evidence_weight * eo + shaping  # R = F1 + 0.5·EO + r_s
    return {
        "em": em,
        "f1": f1,
        "eo": eo,
        "multi_turn": multi_turn,
        "lazy": lazy,
        "timeout": timeout,
        "redundant": redundant,
        "shaping": shaping,
        "total": total,
    }


def pathrouter_reward(
    outcome: EpisodeOutcome, config: PathRouterConfig = PathRouterConfig()
) -> float:
    """R = F1 + 0.5·EO + r_s."""
    return pathrouter_reward_terms(outcome, config)["total"]


def route_of(correct: bool, evidence_supported: bool) -> Route:
    """The route of a trajectory from its C and P flags."""
    if correct:
        return Route.CORRECT_SUPPORTED if evidence_supported else Route.CORRECT_UNSUPPORTED
    return Route.INCORRECT_SUPPORTED if evidence_supported else Route.INCORRECT_UNSUPPORTED


def pathrouter_flags(
    outcome: EpisodeOutcome, config: PathRouterConfig = PathRouterConfig()
) -> tuple[bool, bool]:
    """(C, P) of one trajectory: C = [EM > 0 or F1 ≥ 0.5], P = [EO ≥ θ_P]."""
    return (is_correct(outcome.em, outcome.f1, config.correct_f1_threshold),
            outcome.evidence_overlap >= config.evidence_threshold)


def pathrouter_route(
    outcome: EpisodeOutcome, config: PathRouterConfig = PathRouterConfig()
) -> Route:
    return route_of(*pathrouter_flags(outcome, config))


def pathrouter_batch_rewards(
    outcomes: Sequence[EpisodeOutcome], config: PathRouterConfig = PathRouterConfig()
) -> list[float]:
    return [pathrouter_reward(o, config) for o in outcomes]
