"""Metrics and the rewards of the five methods, as pure functions of episode records.

* ``metrics`` — EM, cover-EM, token F1 and recall, evidence overlap (EO), unsupported-answer rate
  (defined in ``raggym.text_metrics``), and ``outcome_metrics`` for a whole episode.
* ``routerag``, ``pathrouter``, ``lws``, ``graphrag_r1``, ``r1_router`` — one module per paper,
  each with its equations and citation in the docstring.
* ``schedules`` — training step → reward function for the staged methods.

Episode-level rewards read an ``EpisodeOutcome``; build one from an environment record with
``EpisodeOutcome.from_dict``. See ``docs/algorithms.md`` for the equation → function table.
"""

from raggym.rewards.graphrag_r1 import (
    GraphRAGR1Config,
    cost_aware_f1,
    graphrag_r1_batch_rewards,
    graphrag_r1_format_reward,
    graphrag_r1_phase2_reward,
    graphrag_r1_phase3_reward,
    progressive_retrieval_attenuation,
)
from raggym.rewards.lws import (
    LWSConfig,
    is_concise_query,
    lws_answer_reward,
    lws_format_reward,
    lws_is_correct,
    lws_reward,
    lws_reward_terms,
    lws_search_reward,
    lws_structure_ok,
    mean_pairwise_cosine,
)
from raggym.rewards.metrics import (
    answer_tokens,
    cover_exact_match,
    evidence_overlap,
    exact_match,
    normalize_answer,
    outcome_metrics,
    retrieval_count,
    token_f1,
    token_recall,
    total_retrieval_cost,
    total_retrieval_seconds,
    unsupported_answer_rate,
)
from raggym.rewards.outcome import EpisodeOutcome, outcomes_from_dicts
from raggym.rewards.pathrouter import (
    PathRouterConfig,
    count_redundant_retrievals,
    is_correct,
    pathrouter_batch_rewards,
    pathrouter_flags,
    pathrouter_reward,
    pathrouter_reward_terms,
    pathrouter_route,
    route_of,
)
from raggym.rewards.r1_router import (
    chosen_knowledge_bases,
    final_answer_reward,
    intermediate_answer_reward,
    normalized_dot,
    route_is_gold,
    router_step_reward,
)
from raggym.rewards.routerag import (
    RouteRAGConfig,
    batch_centered_efficiency,
    retrieval_time,
    routerag_batch_rewards,
    routerag_stage1_reward,
    routerag_stage2_rewards,
    scale_retrieval_times,
)
from raggym.rewards.schedules import (
    RewardSchedule,
    StageSchedule,
    exact_match_schedule,
    graphrag_r1_schedule,
    lws_schedule,
    pathrouter_schedule,
    reward_schedule_from_config,
    routerag_schedule,
)

__all__ = [
    "EpisodeOutcome",
    "outcomes_from_dicts",
    # metrics
    "answer_tokens",
    "cover_exact_match",
    "evidence_overlap",
    "exact_match",
    "normalize_answer",
    "outcome_metrics",
    "retrieval_count",
    "token_f1",
    "token_recall",
    "total_retrieval_cost",
    "total_retrieval_seconds",
    "unsupported_answer_rate",
    # RouteRAG
    "RouteRAGConfig",
    "batch_centered_efficiency",
    "retrieval_time",
    "routerag_batch_rewards",
    "routerag_stage1_reward",
    "routerag_stage2_rewards",
    "scale_retrieval_times",
    # PathRouter
    "PathRouterConfig",
    "count_redundant_retrievals",
    "is_correct",
    "pathrouter_batch_rewards",
    "pathrouter_flags",
    "pathrouter_reward",
    "pathrouter_reward_terms",
    "pathrouter_route",
    "route_of",
    # LWS
    "LWSConfig",
    "is_concise_query",
    "lws_answer_reward",
    "lws_format_reward",
    "lws_is_correct",
    "lws_reward",
    "lws_reward_terms",
    "lws_search_reward",
    "lws_structure_ok",
    "mean_pairwise_cosine",
    # GraphRAG-R1
    "GraphRAGR1Config",
    "cost_aware_f1",
    "graphrag_r1_batch_rewards",
    "graphrag_r1_format_reward",
    "graphrag_r1_phase2_reward",
    "graphrag_r1_phase3_reward",
    "progressive_retrieval_attenuation",
    # R1-Router
    "chosen_knowledge_bases",
    "final_answer_reward",
    "intermediate_answer_reward",
    "normalized_dot",
    "route_is_gold",
    "router_step_reward",
    # schedules
    "RewardSchedule",
    "StageSchedule",
    "exact_match_schedule",
    "graphrag_r1_schedule",
    "lws_schedule",
    "pathrouter_schedule",
    "reward_schedule_from_config",
    "routerag_schedule",
]
