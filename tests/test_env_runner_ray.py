"""``EnvRunner`` on Ray with episodes that search: every search's hits are the in-process ones.

The policy is the scripted engine (``actors/engines/scripted.py``) on a rollout-worker actor:
each episode searches twice, each time in a mode it picks from the script's alternatives with
its own seeded stream, then answers. So the episodes' searches of one turn, batched together
by the rollout loop, hold several ``(mode, k)`` groups and repeated queries, which is what
``RayBackend.retrieve`` groups, de-duplicates and maps back to the episodes.
"""

from collections import Counter

import pytest
import ray

from actors.engines.base import SamplingParams
from actors.engines.rollout_worker import RolloutWorker
from actors.env_runner import EnvRunner
from actors.retrieval_service import start_retrieval_service
from envs.rollout import EpisodeRequest
from raggym.retrieval import Retriever
from ray_world import ray_session, sharded_index  # noqa: F401  (fixtures)

# Ray actors started, restarted and waited on (about 5 min of a 2-core machine): `make test-integration`,
# where it runs beside the memory-heavy modules instead of lengthening `make test`.
pytestmark = pytest.mark.integration

SEARCH_MODES = ("[passage]", "[graph]", "[graph][passage]")
SCRIPT = [
    [f"<think>first look-up</think>\n<search> {tag} {{question}} </search>" for tag in SEARCH_MODES],
    [f"<think>second look-up</think>\n<search> {tag} {{question}} </search>" for tag in SEARCH_MODES[:2]],
    "<think>done</think>\n<answer> unknown </answer>",
]
TOP_K = 2
SEARCHES_PER_EPISODE = 2


def test_every_episode_gets_exactly_the_in_process_hits(ray_session, sharded_index, small_world):
    service, *peers = start_retrieval_service(str(sharded_index), num_replicas=1)  # peers: keeps the shards alive
    Worker = RolloutWorker.as_remote(num_cpus=0.25)
    workers = [Worker.remote(engine="scripted", model="smollm2-135m", script=SCRIPT)]
    runner = EnvRunner.as_remote(num_cpus=0.25).remote(
        "raggym/RouteRAG-v0", service, workers, "smollm2-135m", {"top_k": TOP_K, "retrieval_budget": 3},
        {"max_response_tokens": 256, "max_turn_tokens": 96, "max_observation_tokens": 512})
    questions = small_world.questions[:6]
    requests = [EpisodeRequest(q, f"0:{q.id}", g) for q in questions for g in range(3)]
    episodes, stats = ray.get(runner.rollout_with_stats.remote(requests, SamplingParams(seed=11)), timeout=300)

    assert len(episodes) == len(requests)
    local = Retriever.load(sharded_index)
    searches_by_turn: dict[int, list[tuple[str, str]]] = {}
    for request, episode in zip(requests, episodes):
        (rollout,) = episode  # RouteRAG appends to one transcript: one rollout per episode
        assert rollout.prompt_id == request.prompt_id and rollout.sample_index == request.sample_index
        turns = [t for t in rollout.episode["turns"] if t["query"] is not None]
        assert len(turns) == SEARCHES_PER_EPISODE and rollout.outcome.answer == "unknown"
        for turn_number, turn in enumerate(turns):
            assert turn["query"] == request.question.question
            (expected,) = local.retrieve([turn["query"]], turn["mode"], TOP_K)
            assert expected.hits, "the in-process retriever finds something for every question"
            assert turn["retrieved_ids"] == [h.id for h in expected.hits]
            assert turn["retrieved_titles"] == [h.title for h in expected.hits]
            assert turn["retrieved_texts"] == [h.text for h in expected.hits]
            searches_by_turn.setdefault(turn_number, []).append((turn["mode"], turn["query"]))

    # The inputs reach every path of the grouping: one turn's searches hold several modes (several
    # groups) and repeated (mode, query) pairs (de-duplicated to one query each).
    assert any(len({mode for mode, _ in s}) > 1 for s in searches_by_turn.values())
    assert any(max(Counter(s).values()) > 1 for s in searches_by_turn.values())
    # The runner's retrieval memo (envs/retrieval_memo.py) asked the service once per distinct
    # (mode, query) of the call, however the searches fell into batches; an episode that repeats its
    # own first search is served from the memo (its first search's batch went out before).
    searches = [search for turn in searches_by_turn.values() for search in turn]
    assert stats["retrieval_requests"] == len(searches) == SEARCHES_PER_EPISODE * len(requests)
    assert stats["retrieval_unique"] == len(set(searches))
    assert stats["retrieval_memo_hits"] + stats["retrieval_batch_duplicates"] == len(searches) - len(set(searches))
    repeats = sum(first == second for first, second in zip(searches_by_turn[0], searches_by_turn[1]))
    assert repeats > 0 and stats["retrieval_memo_hits"] >= repeats


def test_sessions_stick_to_one_worker_and_spread_over_the_least_loaded(ray_session, sharded_index, small_world, tmp_path):
    import json

    log = tmp_path / "calls.jsonl"
    service, *peers = start_retrieval_service(str(sharded_index), num_replicas=1)  # peers: keeps the shards alive
    Worker = RolloutWorker.as_remote(num_cpus=0.25)
    workers = [Worker.remote(engine="scripted", model="smollm2-135m", script=SCRIPT, delay_s=0.3, call_log=str(log))
               for _ in range(2)]
    Runner = EnvRunner.as_remote(num_cpus=0.25)
    config = {"max_response_tokens": 256, "max_turn_tokens": 96, "max_observation_tokens": 512}
    both = Runner.remote("raggym/RouteRAG-v0", service, workers, "smollm2-135m", {"top_k": TOP_K}, config)
    requests = [EpisodeRequest(q, f"0:{q.id}", g) for q in small_world.questions[:4] for g in range(2)]
    episodes = ray.get(both.rollout.remote(requests, SamplingParams(seed=11)), timeout=300)

    calls = [json.loads(line) for line in log.read_text().splitlines() if '"start"' in line]
    pids_of_session: dict[str, set] = {}
    for call in calls:
        pids_of_session.setdefault(call["session"], set()).add(call["pid"])
    assert len(pids_of_session) == len(requests)  # one session per episode
    assert all(len(pids) == 1 for pids in pids_of_session.values())  # every turn on the session's worker
    assert sorted(Counter(next(iter(p)) for p in pids_of_session.values()).values()) == [4, 4]  # least-loaded
    assert len(calls) == 3 * len(requests)  # search, search, answer
    # the samples depend on the episodes, not on the workers they ran on
    alone = Runner.remote("raggym/RouteRAG-v0", service, workers[:1], "smollm2-135m", {"top_k": TOP_K}, config)
    same = ray.get(alone.rollout.remote(requests, SamplingParams(seed=11)), timeout=300)
    assert [[r.token_ids for r in e] for e in same] == [[r.token_ids for r in e] for e in episodes]


def test_the_runtime_keeps_each_group_on_one_runner_and_sums_the_runners_counts(ray_session, sharded_index, small_world):
    from actors.runtime import RayRuntime

    service, *peers = start_retrieval_service(str(sharded_index), num_replicas=1)  # peers: keeps the shards alive
    Worker = RolloutWorker.as_remote(num_cpus=0.25)
    workers = [Worker.remote(engine="scripted", model="smollm2-135m", script=SCRIPT)]
    Runner = EnvRunner.as_remote(num_cpus=0.25)
    config = {"max_response_tokens": 256, "max_turn_tokens": 96, "max_observation_tokens": 512}
    runners = [Runner.remote("raggym/RouteRAG-v0", service, workers, "smollm2-135m", {"top_k": TOP_K}, config)
               for _ in range(2)]
    # RayRuntime.rollout alone, over these runners (its constructor would start a whole run's actors)
    runtime = object.__new__(RayRuntime)
    runtime.learners, runtime.corpus, runtime.runners = None, None, lambda env_kwargs: runners
    requests = [EpisodeRequest(q, f"0:{q.id}", g) for q in small_world.questions[:3] for g in range(3)]
    rollouts = runtime.rollout(requests, SamplingParams(seed=11))

    assert [(r.prompt_id, r.sample_index) for r in rollouts] == [(r.prompt_id, r.sample_index) for r in requests]
    searches = [(t["mode"], t["query"]) for r in rollouts for t in r.episode["turns"] if t["query"] is not None]
    stats = runtime.rollout_stats
    assert stats["retrieval_requests"] == len(searches) == SEARCHES_PER_EPISODE * len(requests)
    # a group's samples ran on one runner: each distinct search was retrieved once in all
    assert stats["retrieval_unique"] == len(set(searches))
    assert stats["retrieval_memo_hits"] + stats["retrieval_batch_duplicates"] == len(searches) - len(set(searches))


def test_a_worker_that_refuses_stale_weights_is_found_by_its_refusal_resynced_and_the_rollout_rerun(
        ray_session, sharded_index, small_world, tiny_random_policy):
    """No worker is asked whether it restarted before a rollout: a worker on weights it did not get
    from the learners refuses its first call (``WeightsNotSyncedError``, as one Ray rebuilt does;
    here it is built that way), the runtime loads the current weights into it and runs the rollout
    again. A healthy rollout asks nobody."""
    from actors.learner import LearnerConfig, LearnerGroup
    from actors.runtime import RayRuntime

    service, *peers = start_retrieval_service(str(sharded_index), num_replicas=1)  # peers: keeps the shards alive
    Worker = RolloutWorker.as_remote(num_cpus=0.25)
    workers = [Worker.remote(engine="scripted", model="smollm2-135m", script=SCRIPT),
               Worker.remote(engine="scripted", model="smollm2-135m", script=SCRIPT, require_sync=True)]
    Runner = EnvRunner.as_remote(num_cpus=0.25)
    config = {"max_response_tokens": 256, "max_turn_tokens": 96, "max_observation_tokens": 512}
    runners = [Runner.remote("raggym/RouteRAG-v0", service, workers, "smollm2-135m", {"top_k": TOP_K}, config)]
    learners = LearnerGroup(LearnerConfig.from_dict({"model": tiny_random_policy, "zero_stage": 0, "micro_batch_size": 1,
                                                     "mini_batch_size": 1, "num_threads": 1}),
                            num_learners=1, resources={"num_cpus": 0.5})
    asked = []
    resync = learners.resync_restarted
    learners.resync_restarted = lambda ws: asked.append(len(ws)) or resync(ws)
    runtime = object.__new__(RayRuntime)
    runtime.learners, runtime.workers, runtime.verifier, runtime._sync_ready = learners, workers, None, True
    runtime.corpus, runtime.runners = None, lambda env_kwargs: runners
    requests = [EpisodeRequest(q, f"0:{q.id}", g) for q in small_world.questions[:2] for g in range(2)]
    try:
        assert [ray.get(w.info.remote())["synced"] for w in workers] == [True, False]
        rollouts = runtime.rollout(requests, SamplingParams(seed=11))
        assert asked == [2]  # once, after the refusal
        assert [ray.get(w.info.remote())["synced"] for w in workers] == [True, True]
        assert [(r.prompt_id, r.sample_index) for r in rollouts] == [(r.prompt_id, r.sample_index) for r in requests]
        assert all(r.outcome is not None and r.response_length > 0 for r in rollouts)
        again = runtime.rollout(requests, SamplingParams(seed=11))
        assert asked == [2]  # a healthy rollout asks no worker anything
        assert [r.token_ids for r in again] == [r.token_ids for r in rollouts]
    finally:
        learners.shutdown()
