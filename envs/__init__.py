"""Gymnasium environments for multi-turn retrieval-augmented agents.

Importing this package registers the environment ids:

============================  ============================  ==========================
id                            class                         dialect (method)
============================  ============================  ==========================
``raggym/RouteRAG-v0``        ``RagSearchEnv``              ``routerag`` (RouteRAG)
``raggym/SearchR1-v0``        ``RagSearchEnv``              ``search_r1`` (Search-R1)
``raggym/GraphR1-v0``         ``RagSearchEnv``              ``graph_r1`` (PathRouter)
``raggym/LWS-v0``             ``RagSearchEnv``              ``lws`` (LWS)
``raggym/GraphRAGR1-v0``      ``RagSearchEnv``              ``graphrag_r1`` (GraphRAG-R1)
``raggym/MultiKBRoute-v0``    ``MultiKBRouteEnv``           ``r1_router`` (R1-Router)
============================  ============================  ==========================

>>> import gymnasium, envs
>>> env = gymnasium.make("raggym/RouteRAG-v0", retriever=my_retriever, questions=my_questions)  # doctest: +SKIP
>>> stepping = envs.batched_step_env(env)  # what the rollout loop calls begin_step/finish_step on  # doctest: +SKIP

Every environment implements the public batched-step protocol of ``envs.stepping``
(``begin_step``, ``finish_step``, ``truncate``, ``check_step_call``, ``stop_strings``, ``record``,
``dialect``, ``context_mode``); ``envs.BatchedStepWrapper`` is the base for wrappers that must
survive batched stepping.
"""

import gymnasium

from envs.batching import step_batch
from envs.multi_kb_route_env import MultiKBRouteEnv, golden_steps
from envs.questions import QuestionPicker
from envs.rag_search_env import RagSearchEnv
from envs.records import EpisodeRecord, RouteEpisodeRecord, RouteStepRecord, TurnRecord
from envs.retriever import Retriever
from envs.rewards import exact_match_reward
from envs.spaces import UnicodeText
from envs.stepping import (
    CONTEXT_MODES,
    BatchedStepEnv,
    RetrievalRequest,
    StepResult,
    run_retrieval,
    step_through,
)
from envs.wrappers import BatchedStepWrapper, batched_step_env

SEARCH_ENV_IDS = {
    "raggym/RouteRAG-v0": "routerag",
    "raggym/SearchR1-v0": "search_r1",
    "raggym/GraphR1-v0": "graph_r1",
    "raggym/LWS-v0": "lws",
    "raggym/GraphRAGR1-v0": "graphrag_r1",
}
MULTI_KB_ENV_ID = "raggym/MultiKBRoute-v0"
ENV_IDS = (*SEARCH_ENV_IDS, MULTI_KB_ENV_ID)


def _register() -> None:
    # Re-importing (for example under importlib.reload) must not re-register and warn.
    for env_id, dialect in SEARCH_ENV_IDS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(
                env_id, entry_point="envs.rag_search_env:RagSearchEnv", kwargs={"dialect": dialect}
            )
    if MULTI_KB_ENV_ID not in gymnasium.registry:
        gymnasium.register(MULTI_KB_ENV_ID, entry_point="envs.multi_kb_route_env:MultiKBRouteEnv")


_register()

__all__ = [
    "CONTEXT_MODES",
    "ENV_IDS",
    "SEARCH_ENV_IDS",
    "MULTI_KB_ENV_ID",
    "BatchedStepEnv",
    "BatchedStepWrapper",
    "EpisodeRecord",
    "MultiKBRouteEnv",
    "QuestionPicker",
    "RagSearchEnv",
    "RetrievalRequest",
    "Retriever",
    "RouteEpisodeRecord",
    "RouteStepRecord",
    "StepResult",
    "TurnRecord",
    "UnicodeText",
    "batched_step_env",
    "exact_match_reward",
    "golden_steps",
    "run_retrieval",
    "step_batch",
    "step_through",
]
