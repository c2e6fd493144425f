"""RLlib interoperability: every raggym environment id in Ray's env registry.

``register_rllib_envs()`` registers each id of ``envs.ENV_IDS`` with
``ray.tune.registry.register_env``, so RLlib configs (``config.environment("raggym/RouteRAG-v0",
env_config={...})``) and Ray users can create the environments by name. The creator builds the
environment from plain, serialisable ``env_config`` keys:

- ``index``: a directory written by ``raggym index`` / ``Retriever.save`` (loaded once per process);
- ``questions``: a question file (any format ``raggym.data.load_questions`` reads), resolved
  against the index's passages;
- ``service``: instead of ``index``, the name of a running ``RetrievalService`` actor;
- any other key is passed to the environment's constructor (``top_k``, ``retrieval_budget``, ...).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=8)
def _load_index(path: str):
    from raggym.retrieval import Retriever

    return Retriever.load(path)


def make_env_from_config(env_id: str, env_config: dict[str, Any]):
    """The creator behind every registered id (usable without Ray for a local index)."""
    import gymnasium

    import envs  # noqa: F401  (gymnasium registration)
    from raggym.data import load_questions

    cfg = dict(env_config or {})
    index = cfg.pop("index", None)
    service_name = cfg.pop("service", None)
    questions_path = cfg.pop("questions", None)
    if (index is None) == (service_name is None):
        raise ValueError(f"{env_id}: env_config needs exactly one of 'index' (a directory) or 'service' (an actor name)")
    if questions_path is None:
        raise ValueError(f"{env_id}: env_config needs 'questions' (a question file)")
    if index is not None:
        retriever = _load_index(str(index))
        corpus = retriever.corpus
    else:
        import ray

        from actors.env_runner import ServiceRetriever

        retriever = ServiceRetriever(ray.get_actor(service_name))
        corpus = None
    questions = load_questions(questions_path, corpus)
    if env_id == "raggym/MultiKBRoute-v0":
        raise ValueError("raggym/MultiKBRoute-v0 needs several knowledge bases; build it with envs.MultiKBRouteEnv directly")
    return gymnasium.make(env_id, retriever=retriever, questions=questions, corpus=corpus, **cfg)


def register_rllib_envs() -> list[str]:
    """Register every search-environment id with Ray's env registry; returns the ids."""
    from ray.tune.registry import register_env

    import envs

    ids = list(envs.SEARCH_ENV_IDS)
    for env_id in ids:
        register_env(env_id, lambda config, _id=env_id: make_env_from_config(_id, config))
    return ids


__all__ = ["make_env_from_config", "register_rllib_envs"]
