"""``RolloutWorker``: weight versions (a worker that must be synced refuses to generate until it is)
and the session methods, in process and as a Ray async actor that batches concurrent sessions.

The policy is a 2-layer random Llama with SmolLM2's tokenizer (``tiny_random_policy``), so the
Ray actors start fast; what is checked is the worker's behaviour, not the model's quality.
"""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch

from actors.engines import RolloutWorker, SamplingParams
from actors.engines.base import SessionEngine
from actors.engines.rollout_worker import WeightsNotSyncedError
from actors.env_runner import RayBackend
from ray_world import wait_until_restarted

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def test_a_worker_that_requires_sync_refuses_to_generate_until_synced(tiny_random_policy):
    worker = RolloutWorker(engine="hf", model=tiny_random_policy, require_sync=True)
    assert not worker.synced and worker.info()["synced"] is False
    with pytest.raises(WeightsNotSyncedError, match="has not received weights"):
        worker.generate([PROMPT], SamplingParams(seed=0), max_new_tokens=4)
    with pytest.raises(WeightsNotSyncedError):
        asyncio.run(worker.generate_async("s", PROMPT, SamplingParams(seed=0), max_new_tokens=4))
    weights = {n: p.detach().clone() for n, p in worker.engine.model.named_parameters()}
    assert worker.update_weights(weights, version=5) == 5 and worker.synced
    (result,) = worker.generate([PROMPT], SamplingParams(seed=0), max_new_tokens=4)
    assert result.weight_version == 5 and len(result.token_ids) == 4
    session = asyncio.run(worker.generate_async("s", PROMPT, SamplingParams(seed=0), max_new_tokens=4))
    assert session.token_ids == result.token_ids and session.weight_version == 5  # same stream: derive_seed(0, 0)
    assert worker.load() == {"sessions": 1, "running": 0}
    worker.end_session("s")
    assert worker.load() == {"sessions": 0, "running": 0}
    worker.engine.close()


def test_require_sync_options(tiny_random_policy):
    with pytest.raises(ValueError, match="require_sync"):
        RolloutWorker(engine="hf", model=tiny_random_policy, require_sync="sometimes")
    # outside a restarted Ray actor, "after_restart" does not hold generation back
    worker = RolloutWorker(engine="hf", model=tiny_random_policy, require_sync="after_restart")
    assert worker.synced and not worker.restarted
    assert isinstance(worker.sessions, SessionEngine)
    worker.engine.close()


@pytest.mark.integration  # a Ray instance and an actor restart: about 30 s on two cores
def test_ray_worker_serves_concurrent_sessions_and_a_restart_waits_for_weights(tiny_random_policy):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        Worker = RolloutWorker.as_remote(num_cpus=1, max_restarts=1, max_task_retries=0)
        worker = Worker.remote(engine="hf", model=tiny_random_policy, require_sync="after_restart")
        sampling = SamplingParams(temperature=1.0, seed=3)
        # three sessions in flight at once on one actor (an async actor runs them concurrently)
        calls = [worker.generate_async.remote(f"s{i}", PROMPT[: 4 + i], sampling, (), 6) for i in range(3)]
        results = ray.get(calls, timeout=120)
        assert [len(r.token_ids) for r in results] == [6, 6, 6]
        assert ray.get(worker.load.remote()) == {"sessions": 3, "running": 0}
        # each equals the same request alone (its stream depends on its seed only)
        (alone,) = ray.get([worker.generate_async.remote("alone", PROMPT[:5], sampling, (), 6)])
        assert alone.token_ids == results[1].token_ids
        # a plain generate still works on the async actor
        (plain,) = ray.get(worker.generate.remote([PROMPT[:5]], sampling, (), 6))
        assert plain.token_ids == results[1].token_ids

        # an episode's session through the env runner's backend: its second turn sends only the observation
        backend = RayBackend([worker])
        first = asyncio.run(backend.generate("episode", PROMPT, sampling, (), 4))
        second_context = PROMPT + first.token_ids + [40, 41]
        asyncio.run(backend.generate("episode", second_context, sampling, (), 4))
        assert backend.contexts.counts() == {"context_ids_sent": len(PROMPT) + 2,
                                             "context_ids": len(PROMPT) + len(second_context)}

        info = ray.get(worker.info.remote())
        assert info["synced"] and not info["restarted"]
        ray.kill(worker, no_restart=False)  # the process dies; Ray rebuilds the actor with the same arguments
        wait_until_restarted(worker)
        with pytest.raises(WeightsNotSyncedError):
            ray.get(worker.generate_async.remote("s0", PROMPT, sampling, (), 4), timeout=120)
        with pytest.raises(WeightsNotSyncedError):
            ray.get(worker.generate.remote([PROMPT], sampling, (), 4), timeout=120)
        weights = {n: torch.zeros_like(p) if n.endswith("norm.weight") else p.detach().clone()
                   for n, p in RolloutWorker(engine="hf", model=tiny_random_policy).engine.model.named_parameters()}
        assert ray.get(worker.update_weights_async.remote(weights, 9)).version == 9
        after = ray.get(worker.generate_async.remote("s0", PROMPT, sampling, (), 4), timeout=120)
        assert after.weight_version == 9 and len(after.token_ids) == 4
        # the restarted worker holds nothing of the episode: it refuses the delta, and the backend
        # sends the third turn whole, which samples what a fresh session of that context samples
        third_context = second_context + [7, 7, 7, 50]
        sent_before = backend.contexts.counts()["context_ids_sent"]
        third = asyncio.run(backend.generate("episode", third_context, sampling, (), 4))
        assert backend.contexts.counts()["context_ids_sent"] - sent_before == len(third_context)
        fresh = ray.get(worker.generate_async.remote("fresh", third_context, sampling, (), 4), timeout=120)
        assert third.token_ids == fresh.token_ids and third.weight_version == 9
        # an ended episode costs no call: its end rides on the backend's next call to the worker
        sessions = ray.get(worker.load.remote())["sessions"]
        backend.end_session("episode")
        assert ray.get(worker.load.remote())["sessions"] == sessions  # nothing has told the worker yet
        asyncio.run(backend.generate("after", PROMPT, sampling, (), 2))
        assert ray.get(worker.load.remote())["sessions"] == sessions  # "episode" freed, "after" opened
    finally:
        ray.shutdown()
