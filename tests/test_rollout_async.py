"""The async rollout loop: one coroutine per episode, retrieval batched across episodes.

The policy is the registered scripted engine (``actors/engines/scripted.py``) in this process, so
the segments are known; the environments and the retriever are the real ones.
"""

import json
import time
from types import SimpleNamespace

import pytest

from actors.engines import SamplingParams, make_engine
from envs.session_adapter import BatchingSessionEngine, cut_result
from envs import RagSearchEnv
from envs.rollout import EpisodeRequest, LocalBackend, MultiTurnRollout, RolloutConfig
from actors.runtime import bound_staleness
from raggym.staleness import drop_stale, rollout_staleness
from raggym.trajectory import Rollout

SEARCHES = ("[passage]", "[graph]")
FIXED_SCRIPT = [
    "<think>first</think>\n<search> [passage] {question} </search>",
    "<think>second</think>\n<search> [graph] {question} </search>",
    "<think>done</think>\n<answer> unknown </answer>",
]
CHOICE_SCRIPT = [
    [f"<think>look {i}</think>\n<search> {tag} {{question}} </search>" for i, tag in enumerate(SEARCHES * 2)],
    ["<think>done</think>\n<answer> a </answer>", "<think>more</think>\n<search> [graph] {question} </search>"],
    "<think>done</think>\n<answer> b </answer>",
]
WINDOW_S = 10.0
CONFIG = dict(max_response_tokens=200, max_turn_tokens=64, max_observation_tokens=64)


@pytest.fixture(scope="module")
def tokenizer(hf_engine):
    return hf_engine.tokenizer


def _run(engine, retriever, questions, requests, sampling=None, **config):
    envs = [RagSearchEnv(retriever, questions, dialect="routerag", top_k=2) for _ in requests]
    rollout = MultiTurnRollout(LocalBackend(engine), engine.tokenizer, sampling, RolloutConfig(**{**CONFIG, **config}))
    return rollout, rollout.run_episodes(envs, requests)


def _summary(episodes):
    return [[(r.token_ids, r.loss_mask, [(t["query"], t["retrieved_ids"]) for t in r.episode["turns"]]) for r in e]
            for e in episodes]


def test_concurrent_episodes_equal_episodes_run_alone_and_batch_retrieval(tokenizer, small_world, small_world_retriever, tmp_path):
    questions = small_world.questions[:4]
    requests = [EpisodeRequest(q, f"0:{q.id}", g) for q in questions for g in range(2)]
    log = tmp_path / "calls.jsonl"
    engine = make_engine("scripted", tokenizer=tokenizer, script=FIXED_SCRIPT, delay_s=0.2, call_log=str(log))
    started = time.perf_counter()
    # A long window: a batch may only go out early because every live episode has joined it.
    rollout, async_episodes = _run(engine, small_world_retriever, questions, requests,
                                   retrieval_batch_window_s=WINDOW_S)
    assert time.perf_counter() - started < WINDOW_S
    alone = make_engine("scripted", tokenizer=tokenizer, script=FIXED_SCRIPT)
    one_by_one = [_run(alone, small_world_retriever, questions, [request])[1][0] for request in requests]
    # a script without choices: running together builds the records each episode builds alone
    assert _summary(async_episodes) == _summary(one_by_one)
    assert all(len(r.turns) == 3 and r.outcome.answer == "unknown" for e in async_episodes for r in e)
    # every episode searched twice, and each round of searches went out as one batch of all eight
    assert rollout.retrieval_batches == [8, 8]
    # every episode's requests were in flight together: the engine saw all 8 sessions at once
    events = [json.loads(line) for line in log.read_text().splitlines()]
    open_now, most = 0, 0
    for e in sorted(events, key=lambda e: (e["time"], e["event"] == "start")):
        open_now += 1 if e["event"] == "start" else -1
        most = max(most, open_now)
    assert most == len(requests)
    assert len({e["session"] for e in events}) == len(requests)  # one session per episode
    assert engine.load() == {"sessions": 0, "running": 0}  # every session was ended


def test_seeded_samples_depend_on_the_episode_only(tokenizer, small_world, small_world_retriever):
    questions = small_world.questions[:3]
    requests = [EpisodeRequest(q, f"0:{q.id}", g) for q in questions for g in range(3)]
    engine = make_engine("scripted", tokenizer=tokenizer, script=CHOICE_SCRIPT)
    sampling = SamplingParams(seed=4)
    _, full = _run(engine, small_world_retriever, questions, requests, sampling)
    _, again = _run(engine, small_world_retriever, questions, requests, sampling)
    assert _summary(full) == _summary(again)
    # the same episodes in another order and with fewer companions draw the same samples
    subset = [requests[i] for i in (7, 2, 4)]
    _, alone = _run(engine, small_world_retriever, questions, subset, sampling)
    assert _summary(alone) == _summary([full[i] for i in (7, 2, 4)])
    # the choices do differ between episodes (each has its own stream), and a new seed changes them
    assert len({tuple(r.turn_token_ids()[0]) for e in full for r in e}) > 1
    _, other = _run(engine, small_world_retriever, questions, requests, SamplingParams(seed=5))
    assert _summary(other) != _summary(full)


def test_budgets_cut_turns_and_end_episodes_in_the_async_loop(tokenizer, small_world, small_world_retriever):
    questions = small_world.questions[:2]
    requests = [EpisodeRequest(q, q.id) for q in questions]
    engine = make_engine("scripted", tokenizer=tokenizer, script=FIXED_SCRIPT)
    _, episodes = _run(engine, small_world_retriever, questions, requests, max_turn_tokens=10,
                       max_response_tokens=25)
    for (r,) in episodes:
        assert all(len(ids) <= 10 for ids in r.turn_token_ids()) and r.response_length <= 25
        assert r.truncated_by_length and r.episode["truncation_reason"] == "response_tokens"
    _, capped = _run(engine, small_world_retriever, questions, requests, max_sequence_tokens=400)
    for (r,) in capped:
        assert len(r.token_ids) <= 400
        assert r.truncated_by_length and r.episode["truncation_reason"] == "sequence_tokens"


def test_batching_adapter_batches_unseeded_requests_and_cuts_exactly(hf_engine):
    import asyncio

    prompts = [hf_engine.tokenizer(f"Question {i}: what is", add_special_tokens=False)["input_ids"] for i in range(3)]
    adapter = BatchingSessionEngine(hf_engine)

    async def requests(sampling, caps):
        return await asyncio.gather(*[adapter.generate_async(f"s{i}", p, sampling, (), cap)
                                      for i, (p, cap) in enumerate(zip(prompts, caps))])

    greedy = SamplingParams(temperature=0.0)
    results = asyncio.run(requests(greedy, [4, 6, 6]))
    assert adapter.calls == [3]  # pending together: one generate call
    expected = hf_engine.generate(prompts, greedy, (), 6)
    assert [r.token_ids for r in results] == [expected[0].token_ids[:4], expected[1].token_ids, expected[2].token_ids]
    assert results[0].finish_reason == "length" and len(results[0].logprobs) == 4
    seeded = asyncio.run(requests(SamplingParams(seed=9), [5, 5, 5]))
    assert adapter.calls[1:] == [1, 1, 1]  # a seeded request samples alone, as generate([context]) would
    for prompt, result in zip(prompts, seeded):
        (alone,) = hf_engine.generate([prompt], SamplingParams(seed=9), (), 5)
        assert result.token_ids == alone.token_ids
    assert cut_result(expected[1], 2, hf_engine.tokenizer).text == hf_engine.tokenizer.decode(expected[1].token_ids[:2])
    assert adapter.load() == {"sessions": 3, "running": 0}


def _rollout(prompt_id, versions, step_index=0):
    return Rollout(prompt_id=prompt_id, step_index=step_index, turns=[{"weight_version": v} for v in versions])


def test_drop_stale_keeps_whole_groups_within_the_bound():
    batch = [_rollout("a", [5, 5]), _rollout("a", [5]), _rollout("b", [4, 5]), _rollout("b", [5]), _rollout("c", [])]
    assert [rollout_staleness(r, 5) for r in batch] == [0, 0, 1, 0, 0]
    kept, dropped = drop_stale(batch, current_version=5, max_staleness=0)
    assert [r.prompt_id for r in kept] == ["a", "a", "c"] and [r.prompt_id for r in dropped] == ["b", "b"]
    kept, dropped = drop_stale(batch, current_version=5, max_staleness=1)
    assert len(kept) == 5 and not dropped
    kept, _ = drop_stale(batch, current_version=7, max_staleness=1)
    assert [r.prompt_id for r in kept] == ["c"]
    config = SimpleNamespace(rollout=SimpleNamespace(max_staleness=1))  # what the trainer reads
    kept, metrics = bound_staleness(config, batch, current_version=6)
    assert [r.prompt_id for r in kept] == ["a", "a", "c"] and metrics == {"stale_rollouts_dropped": 2.0}
    with pytest.raises(ValueError, match="newer than the trainer's current version"):
        rollout_staleness(_rollout("a", [6]), 5)
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        drop_stale(batch, 5, -1)
