"""``EnvRunner``: many environment instances stepped in batches, as a Ray actor.

The runner owns environments (any registered id, with the wrappers ``gymnasium.make`` applies)
but no big data: their retrievers are clients of ``RetrievalService`` actors (one service, or
one per knowledge base for R1-Router's routing env). It drives ``envs.rollout.MultiTurnRollout``
with a ``RayBackend``, whose generation goes to rollout-worker actors and whose retrieval goes to
the services, both asynchronously. In the async loop every episode is a coroutine awaiting its own
engine requests, on the worker its session sticks to (a new session goes to the least-loaded
worker), while the searches of all episodes waiting on retrieval go out as one batched call per
service.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Sequence

from actors.cluster import resolve_actors
from actors.engines.session_context import SentContexts, SessionContextLostError
from envs.rollout import EpisodeRequest, MultiTurnRollout, RolloutConfig
from envs.stepping import RetrievalGroup, RetrievalRequest, place_answers, retrieval_groups, run_retrieval
from raggym.data import Passage


class ServiceRetriever:
    """Synchronous ``Retriever`` facade over the service actor (for plain ``env.step``)."""

    def __init__(self, service):
        self.service = service

    def retrieve(self, queries, mode="passage", k=3):
        import ray

        return ray.get(self.service.retrieve.remote(list(queries), mode, k))


class RayBackend:
    """Generation on rollout workers, retrieval on the services; both asynchronous.

    Each session (an episode, or one model call in ``replace`` mode) sticks to one worker, so a session
    engine reuses its KV cache across the episode's turns; a new session goes to the worker with the
    fewest of this runner's open sessions, ties rotating. No worker is asked for its load: each
    runner spreads its own sessions evenly, so several runners together leave the workers at most
    one session per runner apart, without a Ray call per rollout to learn it. The worker keeps each session's context, so a turn sends only the ids after the part
    it holds (``continue_session``); a worker that lost it (restarted) refuses, and the turn is sent
    whole. The workers are ``RolloutWorker`` actors (``actors.engines.rollout_worker``), whatever
    engine each runs: the worker gives every engine the session API.
    """

    def __init__(self, rollout_workers: Sequence[Any]):
        if not rollout_workers:
            raise ValueError("RayBackend needs at least one rollout worker")
        self.workers = list(rollout_workers)
        self._next_worker = itertools.cycle(range(len(self.workers)))
        self._session_worker: dict[str, int] = {}
        self.open_sessions = [0] * len(self.workers)  # this backend's sessions on each worker
        self.contexts = SentContexts()  # per session, the ids its worker holds
        self.ended: list[list[str]] = [[] for _ in self.workers]  # per worker, ended since our last call to it

    def worker_of(self, session_id: str) -> int:
        """The worker a session runs on; a new session goes to the least-loaded one."""
        index = self._session_worker.get(session_id)
        if index is None:
            start = next(self._next_worker)  # ties rotate, so runners do not all pile onto worker 0
            order = [(start + j) % len(self.workers) for j in range(len(self.workers))]
            index = min(order, key=lambda i: self.open_sessions[i])
            self._session_worker[session_id] = index
            self.open_sessions[index] += 1
        return index

    async def generate(self, session_id: str, context_token_ids, sampling, stop_strings, max_new_tokens: int):
        index = self.worker_of(session_id)
        worker = self.workers[index]
        keep, new_ids = self.contexts.delta(session_id, context_token_ids)
        args = (sampling, list(stop_strings), int(max_new_tokens))
        ended, self.ended[index] = self.ended[index], []
        try:
            result = await worker.continue_session.remote(session_id, keep, new_ids, *args, ended=ended)
        except SessionContextLostError:  # the worker was restarted: it holds nothing of the session
            keep, new_ids = 0, list(context_token_ids)
            result = await worker.continue_session.remote(session_id, keep, new_ids, *args)
        self.contexts.sent(session_id, context_token_ids, new_ids, result.token_ids)
        return result

    def end_session(self, session_id: str) -> None:
        index = self._session_worker.pop(session_id, None)
        if index is None:
            return
        self.open_sessions[index] -= 1
        self.contexts.forget(session_id)
        # The worker frees what it holds of the session when this backend next calls it: the end
        # rides on that turn rather than taking a Ray call of its own (at most one rollout's ended
        # sessions wait on a worker, a few thousand ids each).
        self.ended[index].append(session_id)

    async def retrieve(self, requests: Sequence[RetrievalRequest]) -> list:
        """One ``retrieve_groups`` call per service for the batch, its groups by (mode, k).

        The rollout loop's batcher has already folded identical requests (``envs.retrieval_memo``),
        so every query goes out as it came."""
        requests = list(requests)
        if not all(isinstance(r.retriever, ServiceRetriever) for r in requests):
            return await asyncio.to_thread(run_retrieval, requests)  # envs with in-process retrievers
        by_service: dict[int, list[RetrievalGroup]] = {}
        for group in retrieval_groups(requests):
            by_service.setdefault(id(group.retriever.service), []).append(group)
        calls = [groups[0].retriever.service.retrieve_groups.remote(
                     [(g.mode, g.k, [requests[i].query for i in g.members]) for g in groups])
                 for groups in by_service.values()]
        per_service = await asyncio.gather(*calls)  # each service's answers, one list per group
        groups = [g for service_groups in by_service.values() for g in service_groups]
        return place_answers(groups, [answers for answered in per_service for answers in answered], len(requests))


class EnvRunner:
    """Holds environments of one registered id and rolls out batches of episode requests.

    ``services`` is one ``RetrievalService`` actor (the env gets ``retriever=``) or a mapping
    knowledge-base name -> service (the env gets ``knowledge_bases=``, as R1-Router's routing env
    takes them). ``env_kwargs`` go to ``gymnasium.make``. Plain class;
    ``EnvRunner.as_remote(**ray_options)`` gives the actor class.
    """

    def __init__(self, env_id: str, services, rollout_workers: Sequence[Any], tokenizer_spec: str,
                 env_kwargs: dict | None = None, rollout_config: dict | None = None, num_threads: int = 1):
        import gymnasium
        import torch

        import envs  # noqa: F401  (registers the ids)
        from raggym.models import load_policy_tokenizer

        torch.set_num_threads(num_threads)
        self.env_id = env_id
        # services and workers may come by Ray name (RayRuntime passes names: actors.cluster.resolve_actors)
        services, rollout_workers = resolve_actors(services), resolve_actors(list(rollout_workers))
        if isinstance(services, dict):
            retrievers = {"knowledge_bases": {name: ServiceRetriever(s) for name, s in services.items()}}
        else:
            retrievers = {"retriever": ServiceRetriever(services)}
        self.env_kwargs = dict(env_kwargs or {})
        self.tokenizer = load_policy_tokenizer(tokenizer_spec)
        self.backend = RayBackend(rollout_workers)
        self.config = RolloutConfig(**(rollout_config or {}))
        self._make = lambda questions, corpus: gymnasium.make(env_id, questions=questions, corpus=corpus,
                                                              **retrievers, **self.env_kwargs)

    @classmethod
    def as_remote(cls, **ray_options):
        import ray

        return ray.remote(**ray_options)(cls) if ray_options else ray.remote(cls)

    def rollout(self, requests: Sequence[EpisodeRequest], sampling=None, gold_passages: Sequence[Passage] = ()) -> list:
        """Run one episode per request; returns, per request, its ``raggym.trajectory.Rollout`` records.

        ``gold_passages`` (the requests' gold ``Passage``s) let the episode records carry the gold
        evidence texts that evidence overlap needs, without shipping the corpus to the runner.
        """
        return self.rollout_with_stats(requests, sampling, gold_passages)[0]

    def rollout_with_stats(self, requests: Sequence[EpisodeRequest], sampling=None,
                           gold_passages: Sequence[Passage] = ()) -> tuple[list, dict[str, int]]:
        """``rollout``'s episodes and the call's counts: retrieval (``MultiTurnRollout.retrieval_stats``:
        requests, retrievals sent, memo hits, duplicates folded within a batch) and context ids
        (``context_ids_sent`` to the workers, against ``context_ids`` had every turn been sent whole)."""
        corpus = {p.id: p for p in gold_passages}
        questions = [r.question for r in requests]
        envs = [self._make(questions, corpus) for _ in requests]
        loop = MultiTurnRollout(self.backend, self.tokenizer, sampling, self.config)
        before = self.backend.contexts.counts()
        episodes = loop.run_episodes(envs, list(requests))
        sent = {name: value - before[name] for name, value in self.backend.contexts.counts().items()}
        return episodes, {**loop.retrieval_stats, **sent}

    def ping(self) -> bool:
        return True


__all__ = ["EnvRunner", "RayBackend", "ServiceRetriever"]
