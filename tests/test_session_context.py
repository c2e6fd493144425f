"""A session's context kept on the rollout worker: each turn sends only its new ids, and the
engine still sees the whole context (``actors.engines.session_context``, ``RolloutWorker.continue_session``).

The worker is a real ``RolloutWorker`` on the HF engine with a 2-layer random Llama
(``tiny_random_policy``); a turn sent as a delta must sample exactly what the same turn sent whole
samples, turn after turn, including turns whose sampled ids the caller cut.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.engines import RolloutWorker, SamplingParams
from actors.engines.session_context import HeldContexts, SentContexts, SessionContextLostError, shared_prefix_length
from actors.env_runner import RayBackend

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
OBSERVATIONS = [[40, 41, 42], [50, 51], [60, 61, 62, 63]]


def naive_shared_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


ids = st.lists(st.integers(0, 3), max_size=40)


@given(ids, ids)
def test_shared_prefix_length_is_the_number_of_leading_ids_in_common(a, b):
    assert shared_prefix_length(a, b) == naive_shared_prefix(a, b)


@given(ids, ids, ids)
def test_shared_prefix_length_of_a_context_that_continues_the_held_ids(common, held_tail, new_tail):
    held, context = common + held_tail, common + new_tail
    expected = len(common) + naive_shared_prefix(held_tail, new_tail)
    assert shared_prefix_length(held, context) == expected


def test_held_contexts_rebuild_from_the_kept_ids_and_refuse_what_they_do_not_hold():
    held = HeldContexts()
    assert held.rebuild("s", 0, [1, 2, 3]) == [1, 2, 3]
    held.record("s", [1, 2, 3], [7, 8])
    assert held.rebuild("s", 5, [9]) == [1, 2, 3, 7, 8, 9]
    assert held.rebuild("s", 4, [9]) == [1, 2, 3, 7, 9]  # the caller kept one of the two sampled ids
    with pytest.raises(SessionContextLostError, match="holds 5"):
        held.rebuild("s", 6, [9])
    held.end("s")
    with pytest.raises(SessionContextLostError, match="holds 0"):
        held.rebuild("s", 1, [9])
    with pytest.raises(ValueError, match="keep"):
        held.rebuild("s", -1, [9])


def test_a_session_sent_as_deltas_samples_what_the_whole_context_samples(tiny_random_policy):
    """Three turns, the second one's sampled ids cut by the caller: each delta turn samples the same
    ids as the whole-context turn, and only the observation's ids cross after the first turn."""
    whole = RolloutWorker(engine="hf", model=tiny_random_policy)
    delta = RolloutWorker(engine="hf", model=tiny_random_policy)
    sent = SentContexts()
    context = list(PROMPT)

    context_lengths = []

    async def turns():
        nonlocal context
        for turn, observation in enumerate(OBSERVATIONS):
            sampling = SamplingParams(temperature=1.0, seed=100 + turn)
            expected = await whole.generate_async("s", context, sampling, (), 5)
            keep, new_ids = sent.delta("s", context)
            got = await delta.continue_session("s", keep, new_ids, sampling, (), 5)
            sent.sent("s", context, new_ids, got.token_ids)
            assert got.token_ids == expected.token_ids and got.logprobs == pytest.approx(expected.logprobs)
            # the first turn sends the prompt; each later one only the observation, the cut turn's too
            assert new_ids == (PROMPT if turn == 0 else OBSERVATIONS[turn - 1])
            context_lengths.append(len(context))
            kept = got.token_ids[:2] if turn == 1 else got.token_ids  # the budget cut turn 1's ids
            context = context + kept + observation

    asyncio.run(turns())
    counts = sent.counts()
    assert counts["context_ids"] == sum(context_lengths) and context_lengths[2] > context_lengths[1] > len(PROMPT)
    assert counts["context_ids_sent"] == len(PROMPT) + len(OBSERVATIONS[0]) + len(OBSERVATIONS[1])
    assert len(delta.contexts) == 1
    delta.end_session("s")
    assert len(delta.contexts) == 0 and delta.load()["sessions"] == 0
    whole.engine.close()
    delta.engine.close()


def test_a_worker_without_the_session_refuses_a_delta_and_takes_the_whole_context(tiny_random_policy):
    worker = RolloutWorker(engine="hf", model=tiny_random_policy)
    sampling = SamplingParams(temperature=1.0, seed=5)
    with pytest.raises(SessionContextLostError, match="send the whole context"):
        asyncio.run(worker.continue_session("s", 4, [9, 10], sampling, (), 3))
    result = asyncio.run(worker.continue_session("s", 0, PROMPT, sampling, (), 3))
    assert len(result.token_ids) == 3
    worker.engine.close()


def test_ended_sessions_ride_on_the_backends_next_call_and_the_worker_frees_them_first(tiny_random_policy):
    """``RayBackend.end_session`` makes no call: the worker frees an ended session when the backend
    next calls it (``continue_session(..., ended=...)``), before that turn runs."""
    backend = RayBackend(["worker-0", "worker-1"])  # end_session only keeps books: no actor is called
    index = backend.worker_of("a")
    backend.end_session("a")
    assert backend.ended[index] == ["a"] and backend.ended[1 - index] == [] and backend.open_sessions == [0, 0]
    worker = RolloutWorker(engine="hf", model=tiny_random_policy)
    sampling = SamplingParams(temperature=1.0, seed=7)
    asyncio.run(worker.continue_session("a", 0, PROMPT, sampling, (), 3))
    asyncio.run(worker.continue_session("b", 0, PROMPT, sampling, (), 3))
    assert len(worker.contexts) == 2 and worker.load()["sessions"] == 2
    asyncio.run(worker.continue_session("b", len(PROMPT) + 3, [9], sampling, (), 3, ended=["a"]))
    assert len(worker.contexts) == 1 and worker.load()["sessions"] == 1  # "a" is gone, "b" went on
    with pytest.raises(SessionContextLostError):  # nothing of "a" is held any more
        asyncio.run(worker.continue_session("a", 4, [9], sampling, (), 3))
    worker.engine.close()
