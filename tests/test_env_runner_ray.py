"""``EnvRunner`` on Ray with episodes that search: every search's hits are the in-process ones.

The policy is the scripted engine (``actors/engines/scripted.py``) on a rollout-worker actor:
each episode searches twice, each time in a mode it picks from the script's alternatives with
its own seeded stream, then answers. So the episodes' searches of one turn, batched together
by the rollout loop, hold several ``(mode, k)`` groups and repeated queries, which is what
``RayBackend.retrieve`` groups, de-duplicates and maps back to the episodes.
"""

from collections import Counter

import ray

from actors.engines.base import SamplingParams
from actors.engines.rollout_worker import RolloutWorker
from actors.env_runner import EnvRunner
from actors.retrieval_service import start_retrieval_service
from envs.rollout import EpisodeRequest
from raggym.retrieval import Retriever
from ray_world import ray_session, sharded_index  # noqa: F401  (fixtures)

SEARCH_MODES = ("[passage]", "[graph]", "[graph][passage]")
SCRIPT = [
    [f"<think>first look-up</think>\n<search> {tag} {{question}} </search>" for tag in SEARCH_MODES],
    [f"<think>second look-up</think>\n<search> {tag} {{question}} </search>" for tag in SEARCH_MODES[:2]],
    "<think>done</think>\n<answer> unknown </answer>",
]
TOP_K = 2
SEARCHES_PER_EPISODE = 2


def test_every_episode_gets_exactly_the_in_process_hits(ray_session, sharded_index, small_world):
    service, _, _ = start_retrieval_service(str(sharded_index), num_replicas=1)
    Worker = RolloutWorker.as_remote(num_cpus=0.25)
    workers = [Worker.remote(engine="scripted", model="smollm2-135m", script=SCRIPT)]
    runner = EnvRunner.as_remote(num_cpus=0.25).remote(
        "raggym/RouteRAG-v0", service, workers, "smollm2-135m", {"top_k": TOP_K, "retrieval_budget": 3},
        {"max_response_tokens": 256, "max_turn_tokens": 96, "max_observation_tokens": 512})
    questions = small_world.questions[:6]
    requests = [EpisodeRequest(q, f"0:{q.id}", g) for q in questions for g in range(3)]
    episodes = ray.get(runner.rollout.remote(requests, SamplingParams(seed=11)), timeout=300)

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


def test_sessions_stick_to_one_worker_and_spread_over_the_least_loaded(ray_session, sharded_index, small_world, tmp_path):
    import json

    log = tmp_path / "calls.jsonl"
    service, _, _ = start_retrieval_service(str(sharded_index), num_replicas=1)
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
