"""Fault tolerance of the rollout path, and RLlib env registration."""

import json
import time

import pytest

ray = pytest.importorskip("ray")

from actors.engines.base import SamplingParams  # noqa: E402
from actors.engines.rollout_worker import RolloutWorker  # noqa: E402
from actors.env_runner import EnvRunner  # noqa: E402
from envs.rollout import EpisodeRequest  # noqa: E402
from actors.retrieval_service import RESTARTS, start_retrieval_service  # noqa: E402
from raggym.retrieval import Retriever  # noqa: E402


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory, small_world):
    d = tmp_path_factory.mktemp("idx") / "world"
    Retriever.build(small_world.corpus, openie=small_world.openie, shards=2, show_progress=False).save(d)
    return d


def test_killing_a_shard_a_runner_and_a_worker_mid_iteration_loses_nothing(ray_session, index_dir, small_world):
    service, shards, _ = start_retrieval_service(str(index_dir), num_replicas=1)
    Worker = RolloutWorker.as_remote(num_cpus=0.5, **RESTARTS)
    workers = [Worker.remote(engine="hf", model="smollm2-135m", num_threads=1) for _ in range(2)]
    Runner = EnvRunner.as_remote(num_cpus=0.25, **RESTARTS)
    cfg = {"max_response_tokens": 24, "max_turn_tokens": 12, "max_observation_tokens": 32, "waves": 2}
    runner = Runner.remote("raggym/SearchR1-v0", service, workers, "smollm2-135m", {"top_k": 2}, cfg)
    ray.get([w.ping.remote() for w in workers] + [runner.ping.remote()])
    questions = small_world.questions[:2]
    requests = [EpisodeRequest(q, f"0:{q.id}", g) for q in questions for g in range(2)]
    args = (requests, SamplingParams(seed=5))
    reference = [r for episode in ray.get(runner.rollout.remote(*args)) for r in episode]

    pending = runner.rollout.remote(*args)
    time.sleep(2.0)
    ray.kill(workers[0], no_restart=False)  # a rollout worker dies mid-generation
    ray.kill(shards[1], no_restart=False)  # an index shard dies
    time.sleep(1.0)
    ray.kill(runner, no_restart=False)  # the env runner dies: its call is retried on the restarted actor
    result = [r for episode in ray.get(pending, timeout=600) for r in episode]

    keys = [(t.prompt_id, t.sample_index) for t in result]
    assert sorted(keys) == sorted((r.prompt_id, r.sample_index) for r in requests)  # nothing lost, nothing duplicated
    # the retried iteration is the same iteration: seeded sampling reproduces every episode
    assert [t.token_ids for t in result] == [t.token_ids for t in reference]
    assert ray.get(service.retrieve.remote(["the director"], "passage", 2))[0].hits  # the shard came back


def test_every_search_env_id_is_in_rays_registry_and_steps(index_dir, small_world, tmp_path):
    from ray.tune.registry import ENV_CREATOR, _global_registry

    from actors.registry import register_rllib_envs
    from raggym.data import write_questions

    ids = register_rllib_envs()
    assert "raggym/RouteRAG-v0" in ids and len(ids) == 5
    qfile = write_questions(tmp_path / "q.jsonl", small_world.questions[:3])
    q = small_world.questions[0]
    for env_id in ids:
        creator = _global_registry.get(ENV_CREATOR, env_id)
        env = creator({"index": str(index_dir), "questions": str(qfile), "top_k": 2})
        prompt, _ = env.reset(seed=0)
        assert isinstance(prompt, str) and len(prompt) > 20
        _, _, terminated, truncated, info = env.step("<answer>no idea</answer>")
        assert terminated or truncated or info.get("format_error")
    with pytest.raises(ValueError, match="exactly one of 'index'"):
        _global_registry.get(ENV_CREATOR, "raggym/RouteRAG-v0")({"questions": str(qfile)})
    _ = (json, q)
