"""Fault tolerance of the rollout path, and RLlib env registration.

The fault test drives the scripted engine (``actors/engines/scripted.py``): every episode
searches twice (each search reaches both index shards) and then answers, and every generate call
takes ``DELAY_S`` seconds and is written to a call log, so the test can see which call is in
flight when it kills an actor.
"""

import json
import time

import pytest
import ray
from ray._private.state import actors as actor_table  # GCS actor table (restart counts), no dashboard needed

from actors.engines.base import SamplingParams
from actors.engines.rollout_worker import RolloutWorker
from actors.env_runner import EnvRunner
from actors.retrieval_service import RESTARTS, start_retrieval_service
from envs.rollout import EpisodeRequest
from ray_world import ray_session, sharded_index  # noqa: F401  (fixtures)

DELAY_S = 2.0  # wide enough that the kill lands while the call it targets still runs
SCRIPT = [  # passage and hybrid searches both go through the dense shards
    "<think>look up</think>\n<search> [passage] {question} </search>",
    "<think>look again</think>\n<search> [graph][passage] {question} </search>",
    "<think>done</think>\n<answer> unknown </answer>",
]


def _calls(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _open_calls(log, pid: int) -> list[dict]:
    """Calls of process ``pid`` that started and have not returned."""
    events = [e for e in _calls(log) if e["pid"] == pid]
    ended = {e["call"] for e in events if e["event"] == "end"}
    return [e for e in events if e["event"] == "start" and e["call"] not in ended]


def _wait_for(condition, what: str, timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _restarts(handle) -> int:
    return int(actor_table(actor_id=handle._actor_id.hex())["NumRestarts"])


def _searches(episodes) -> list[list[tuple]]:
    return [[(t["mode"], t["query"], tuple(t["retrieved_ids"])) for t in r.episode["turns"] if t["query"] is not None]
            for episode in episodes for r in episode]


@pytest.mark.integration  # four actors killed and rebuilt mid-rollout (~4 min here): `make test-integration`
def test_killing_a_worker_a_shard_the_runner_and_the_service_mid_rollout_loses_nothing(ray_session, sharded_index, small_world, tmp_path):
    log = tmp_path / "calls.jsonl"
    service, shards, replicas = start_retrieval_service(str(sharded_index), num_replicas=1)
    Worker = RolloutWorker.as_remote(num_cpus=0.5, **RESTARTS)
    workers = [Worker.remote(engine="scripted", model="smollm2-135m", script=SCRIPT, delay_s=DELAY_S, call_log=str(log))
               for _ in range(2)]
    Runner = EnvRunner.as_remote(num_cpus=0.25, **RESTARTS)
    cfg = {"max_response_tokens": 128, "max_turn_tokens": 64, "max_observation_tokens": 96}
    runner = Runner.remote("raggym/RouteRAG-v0", service, workers, "smollm2-135m", {"top_k": 2, "retrieval_budget": 3}, cfg)
    ray.get([runner.ping.remote()])
    pids = [ray.get(w.info.remote())["pid"] for w in workers]
    requests = [EpisodeRequest(q, f"0:{q.id}", g) for q in small_world.questions[:2] for g in range(2)]
    args = (requests, SamplingParams(seed=5))
    reference = ray.get(runner.rollout.remote(*args))
    assert all(len(s) == 2 for s in _searches(reference))  # every episode searches twice
    log.unlink()

    pending = runner.rollout.remote(*args)
    # 1. worker 0 dies inside generate calls (the async loop has one in flight per session it holds)
    killed_calls = {e["call"] for e in _wait_for(lambda: _open_calls(log, pids[0]), "a generate call on worker 0")}
    ray.kill(workers[0], no_restart=False)
    # 2. shard 1 dies while episodes still have searches to run
    assert not ray.wait([pending], timeout=0)[0], "the rollout finished before the shard was killed"
    ray.kill(shards[1], no_restart=False)
    shard_killed_at = time.time()
    # a second-turn call after the kill means a search was answered without the old shard 1
    _wait_for(lambda: [e for e in _calls(log) if e["event"] == "start" and e["time"] > shard_killed_at and max(e["turns"]) >= 1],
              "a search answered after the shard kill")
    # worker 0's killed call was retried in its restarted process (so from here on, a first-turn
    # call can only come from a rollout that started over)
    _wait_for(lambda: [e for e in _calls(log) if e["event"] == "start" and e["pid"] not in pids], "worker 0's retried call")
    # 3. the env runner dies with its rollout call pending; Ray retries the call on the restarted runner
    assert not ray.wait([pending], timeout=0)[0], "the rollout finished before the runner was killed"
    ray.kill(runner, no_restart=False)
    runner_killed_at = time.time()
    # 4. the retrieval service dies as the retried rollout starts, before its first searches: they are
    # retried on the restarted service, which finds its shards and graph replica again by their names
    _wait_for(lambda: [e for e in _calls(log) if e["event"] == "start" and e["time"] > runner_killed_at],
              "the retried rollout's first generate call")
    assert not ray.wait([pending], timeout=0)[0], "the rollout finished before the service was killed"
    ray.kill(service, no_restart=False)
    result = ray.get(pending, timeout=600)

    calls = _calls(log)
    # the killed worker's calls never returned: they were still running when its process died
    assert not [e for e in calls if e["pid"] == pids[0] and e["event"] == "end" and e["call"] in killed_calls]
    # the retried rollout started over (first turns again) after the runner died; each of its
    # searches went to both shards, so the restarted shard 1 answered them
    assert any(e["event"] == "start" and e["time"] > runner_killed_at and set(e["turns"]) == {0} for e in calls)

    keys = [(r.prompt_id, r.sample_index) for episode in result for r in episode]
    assert sorted(keys) == sorted((r.prompt_id, r.sample_index) for r in requests)  # nothing lost, nothing duplicated
    # the retried iteration is the same iteration: the same segments and the same hits
    assert [[r.token_ids for r in e] for e in result] == [[r.token_ids for r in e] for e in reference]
    assert _searches(result) == _searches(reference)
    # each killed actor came back exactly once; nothing else restarted
    assert [_restarts(w) for w in workers] == [1, 0]
    assert [_restarts(s) for s in shards] == [0, 1]
    assert (_restarts(runner), _restarts(service)) == (1, 1)


def test_every_search_env_id_is_in_rays_registry_and_steps(sharded_index, small_world, tmp_path):
    from ray.tune.registry import ENV_CREATOR, _global_registry

    from actors.registry import register_rllib_envs
    from raggym.data import write_questions

    ids = register_rllib_envs()
    assert "raggym/RouteRAG-v0" in ids and len(ids) == 5
    qfile = write_questions(tmp_path / "q.jsonl", small_world.questions[:3])
    for env_id in ids:
        creator = _global_registry.get(ENV_CREATOR, env_id)
        env = creator({"index": str(sharded_index), "questions": str(qfile), "top_k": 2})
        prompt, _ = env.reset(seed=0)
        assert isinstance(prompt, str) and len(prompt) > 20
        _, _, terminated, truncated, info = env.step("<answer>no idea</answer>")
        assert terminated or truncated or info.get("format_error")
    with pytest.raises(ValueError, match="exactly one of 'index'"):
        _global_registry.get(ENV_CREATOR, "raggym/RouteRAG-v0")({"questions": str(qfile)})
