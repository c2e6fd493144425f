"""``EnvRunner``: many environment instances stepped in batches, as a Ray actor.

The runner owns environments (any registered id) but no big data: their retriever is a client of
the ``RetrievalService`` actor. It drives ``actors.rollout.MultiTurnRollout`` with a
``RayBackend``, whose generation goes to rollout-worker actors and whose retrieval goes to the
service, both asynchronously: while one wave of episodes waits for the engine, another wave's
searches are being answered.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from actors.rollout import MultiTurnRollout, RolloutConfig
from envs.stepping import RetrievalRequest


class ServiceRetriever:
    """Synchronous ``Retriever`` facade over the service actor (for plain ``env.step``)."""

    def __init__(self, service):
        self.service = service

    def retrieve(self, queries, mode="passage", k=3):
        import ray

        return ray.get(self.service.retrieve.remote(list(queries), mode, k))


class RayBackend:
    """Generation on rollout workers (round-robin), retrieval on the service; both async."""

    def __init__(self, rollout_workers: Sequence[Any], service=None):
        if not rollout_workers:
            raise ValueError("RayBackend needs at least one rollout worker")
        self.workers = list(rollout_workers)
        self._next_worker = itertools.cycle(range(len(self.workers)))
        self.service = service
        self._expand: dict[Any, list[int]] = {}

    def submit_generate(self, prompts, sampling, stop_strings, max_new_tokens):
        worker = self.workers[next(self._next_worker)]
        return worker.generate.remote(prompts, sampling, list(stop_strings), int(max_new_tokens))

    def submit_retrieve(self, requests: Sequence[RetrievalRequest]):
        import ray

        if self.service is None or not all(isinstance(r.retriever, ServiceRetriever) for r in requests):
            from envs.stepping import run_retrieval

            return ray.put(run_retrieval(list(requests)))  # envs with in-process retrievers
        # One service call per wave: group by (mode, k), deduplicate identical queries.
        groups: dict[tuple[str, int], dict[str, int]] = {}
        slot_of: list[tuple[tuple[str, int], str]] = []
        for r in requests:
            key = (r.mode, int(r.k))
            groups.setdefault(key, {}).setdefault(r.query, len(groups[key]))
            slot_of.append((key, r.query))
        keys = list(groups)
        ref = self.service.retrieve_groups.remote([(mode, k, list(groups[(mode, k)])) for mode, k in keys])
        offsets = {key: i for i, key in enumerate(keys)}
        self._expand[ref] = [(offsets[key], groups[key][q]) for key, q in slot_of]
        return ref

    def wait_one(self, futures):
        import ray

        ready, _ = ray.wait(list(futures), num_returns=1)
        return ready[0]

    def get(self, future):
        import ray

        value = ray.get(future)
        plan = self._expand.pop(future, None)
        if plan is None:
            return value
        return [value[g][i] for g, i in plan]


class EnvRunner:
    """Holds ``num_envs`` environments of one registered id and rolls out batches of questions.

    ``env_kwargs`` go to ``gymnasium.make`` (minus the retriever, which is the service client).
    Plain class; ``EnvRunner.as_remote(**ray_options)`` gives the actor class.
    """

    def __init__(self, env_id: str, service, rollout_workers: Sequence[Any], tokenizer_spec: str,
                 env_kwargs: dict | None = None, rollout_config: dict | None = None, num_threads: int = 1):
        import gymnasium
        import torch

        import envs  # noqa: F401  (registers the ids)
        from raggym.models import load_policy_tokenizer

        torch.set_num_threads(num_threads)
        self.env_id = env_id
        self.service = service
        self.retriever = ServiceRetriever(service)
        self.env_kwargs = dict(env_kwargs or {})
        self.tokenizer = load_policy_tokenizer(tokenizer_spec)
        self.backend = RayBackend(rollout_workers, service)
        self.config = RolloutConfig(**(rollout_config or {}))
        self._make = lambda questions, corpus: gymnasium.make(env_id, retriever=self.retriever, questions=questions,
                                                              corpus=corpus, **self.env_kwargs).unwrapped

    @classmethod
    def as_remote(cls, **ray_options):
        import ray

        return ray.remote(**ray_options)(cls) if ray_options else ray.remote(cls)

    def rollout(self, questions: Sequence[Any], group_ids: Sequence[str], sample_indices: Sequence[int],
                sampling=None, gold_passages: Sequence[dict] = ()) -> list[dict]:
        """Run one episode per question; returns trajectories as plain dicts (``Trajectory.as_dict``).

        ``gold_passages`` (``{"id","title","text"}`` dicts) let the episode records carry the gold
        evidence texts that evidence overlap needs, without shipping the corpus to the runner.
        """
        from raggym.data import Passage, Question

        qs = [q if isinstance(q, Question) else Question.from_dict(q) for q in questions]
        corpus = {p["id"]: Passage(p["id"], p["title"], p["text"]) for p in gold_passages}
        envs = [self._make(qs, corpus) for _ in qs]
        loop = MultiTurnRollout(self.backend, self.tokenizer, sampling, self.config)
        return [t.as_dict() for t in loop.run(envs, qs, group_ids, sample_indices)]

    def ping(self) -> bool:
        return True


__all__ = ["EnvRunner", "RayBackend", "ServiceRetriever"]
