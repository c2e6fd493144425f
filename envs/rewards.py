"""Default terminal reward for the environments.

Environments take any ``reward_fn(record) -> float`` that reads the finished episode record
(``EpisodeRecord`` or ``RouteEpisodeRecord``); the paper-specific rewards live in
``raggym.rewards``. The default is exact match of the final answer against the gold answers
(SQuAD normalisation, maximum over aliases), which is RouteRAG's stage-1 outcome reward.
"""

from __future__ import annotations


def exact_match_reward(record) -> float:
    """EM(answer, gold answers); 0.0 when the episode ended without an answer. It reads the finished
    record's outcome (``record.outcome()``), whose EM the training rewards then reuse."""
    return float(record.outcome().em)
