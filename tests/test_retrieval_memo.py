"""The rollout call's retrieval memo: a GRPO group's identical searches are retrieved once per call.

The memo itself (``envs.retrieval_memo.RetrievalMemo``) is checked directly; the batcher that uses
it with a controllable retrieve function (in-flight hits, failures); and the whole async rollout
loop with the registered scripted engine (``actors/engines/scripted.py``) in this process, real
``RagSearchEnv`` environments and ``KeywordRetriever``, a real (tiny) retriever that records every
call it gets. A backend gate makes episode i start only once episode i-1 has its search answered,
so the G samples of one question search the same query one after another, in separate batches.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from actors.engines import make_engine
from envs import RagSearchEnv
from envs.batching import step_batch
from envs.retrieval_memo import COUNTERS, RetrievalMemo, retrieve_distinct
from envs.rollout import EpisodeRequest, LocalBackend, MultiTurnRollout, RetrievalBatcher, RolloutConfig
from envs.stepping import RetrievalRequest, retrieval_groups, run_retrieval
from hypothesis import given, strategies as st
from actors.runtime import group_chunks
from raggym.data.types import Question
from test_envs_support import PASSAGES, make_retriever

G = 4
# A question whose words are in four of the retriever's passages: k = 2 and k = 3 retrieve different lists.
QUESTION = Question(id="q-london", question="Was the director of Inception born in London, the capital?",
                    answers=("yes",), gold_passage_ids=(PASSAGES[0].id, PASSAGES[1].id), hops=2)
SEARCH_THEN_ANSWER = ["<think>look</think>\n<search> [passage] {question} </search>",
                      "<think>done</think>\n<answer> London </answer>"]
BOTH_MODES = ["<think>look</think>\n<search> [passage] {question} </search>",
              "<think>again</think>\n<search> [graph] {question} </search>",
              "<think>done</think>\n<answer> London </answer>"]
CONFIG = dict(max_response_tokens=200, max_turn_tokens=64, max_observation_tokens=128)


def _request(retriever, query="capital London Jaws", mode="passage", k=2):
    return RetrievalRequest(None, retriever, mode, k, query, "", None)


# ----------------------------------------------------------------------------- the memo


def test_the_key_is_retriever_mode_k_and_the_exact_query():
    a, b = make_retriever(), make_retriever()
    memo = RetrievalMemo()
    memo.store(_request(a), "answer")
    assert memo.lookup(_request(a)) == "answer"
    for other in (_request(b), _request(a, mode="graph"), _request(a, k=3), _request(a, query="capital London Jaws "),
                  _request(a, query="Capital London Jaws")):
        assert memo.lookup(other) is None
    assert memo.counts() == dict(zip(COUNTERS, (6, 0, 1, 0)))
    memo.forget(_request(a))
    assert memo.lookup(_request(a)) is None and len(memo) == 0
    with pytest.raises(ValueError):
        memo.store(_request(a), None)


def test_fold_sends_each_distinct_request_of_a_batch_once():
    a = make_retriever()
    batch = [_request(a), _request(a, k=3), _request(a), _request(a, mode="graph"), _request(a, k=3)]
    memo = RetrievalMemo()
    for request in batch:
        assert memo.lookup(request) is None
    assert memo.fold(batch) == [0, 1, 0, 3, 1]
    assert memo.counts() == {"retrieval_requests": 5, "retrieval_unique": 3, "retrieval_memo_hits": 0,
                             "retrieval_batch_duplicates": 2}


# ------------------------------------------- one place folds identical requests: the memo

@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["passage", "graph"]), st.integers(1, 3),
                          st.sampled_from(["a", "b", "c"])), max_size=12))
def test_retrieval_groups_partition_a_batch_by_retriever_mode_and_k_in_order(picks):
    retrievers = [make_retriever() for _ in range(3)]
    batch = [_request(retrievers[r], query=q, mode=m, k=k) for r, m, k, q in picks]
    groups = retrieval_groups(batch)
    assert sorted(i for g in groups for i in g.members) == list(range(len(batch)))
    for g in groups:
        assert g.members == sorted(g.members)
        assert all((batch[i].retriever, batch[i].mode, batch[i].k) == (g.retriever, g.mode, g.k) for i in g.members)
    assert len({(id(g.retriever), g.mode, g.k) for g in groups}) == len(groups)
    assert [g.members[0] for g in groups] == sorted(g.members[0] for g in groups)  # first-seen order


def test_run_retrieval_sends_what_it_is_given_one_call_per_group():
    a = make_retriever()
    batch = [_request(a), _request(a, mode="graph"), _request(a), _request(a, query="Inception director")]
    results = run_retrieval(batch)
    # no folding here: identical requests are folded before (the memo), so the duplicate goes out
    assert a.calls == [(("capital London Jaws", "capital London Jaws", "Inception director"), "passage", 2),
                       (("capital London Jaws",), "graph", 2)]
    assert len(results) == 4 and [h.id for h in results[0].hits] == [h.id for h in results[2].hits]


def test_retrieve_distinct_asks_each_distinct_request_once_and_answers_every_request():
    a, b = make_retriever(), make_retriever()
    batch = [_request(a), _request(b), _request(a), _request(a, k=3), _request(b), _request(a)]
    asked: list[list[RetrievalRequest]] = []

    def retrieve(requests):
        asked.append(list(requests))
        return [f"{id(r.retriever)}/{r.mode}/{r.k}/{r.query}" for r in requests]

    answers = retrieve_distinct(batch, retrieve)
    assert asked == [[batch[0], batch[1], batch[3]]]
    assert answers == [f"{id(r.retriever)}/{r.mode}/{r.k}/{r.query}" for r in batch]
    with pytest.raises(RuntimeError, match="2 results for 3 requests"):
        retrieve_distinct(batch, lambda requests: ["one", "two"])


def test_step_batch_retrieves_a_query_two_episodes_share_once():
    retriever = make_retriever()
    envs = [RagSearchEnv(questions=[QUESTION], retriever=retriever, top_k=2) for _ in range(3)]
    for env in envs:
        env.reset(seed=0)
    search = SEARCH_THEN_ANSWER[0].format(question=QUESTION.question)
    other = "<think>look</think>\n<search> [passage] Inception director </search>"
    results = step_batch(envs, [search, other, search])
    assert retriever.calls == [((QUESTION.question, "Inception director"), "passage", 2)]
    assert results[0].observation == results[2].observation != results[1].observation


# ----------------------------------------------------------------------------- the batcher


class GatedRetrieval:
    """``run_retrieval`` behind a gate: each call waits for ``open`` (and fails while ``failing``)."""

    def __init__(self):
        self.calls: list[list[tuple]] = []
        self.open = asyncio.Event()
        self.failing = False

    async def __call__(self, requests):
        self.calls.append([RetrievalMemo.key(r)[1:] for r in requests])
        await self.open.wait()
        if self.failing:
            raise ConnectionError("retrieval service down")
        return run_retrieval(requests)


def test_a_request_identical_to_one_in_flight_waits_for_that_retrieval():
    retriever = make_retriever()

    async def scenario():
        retrieve = GatedRetrieval()
        batcher = RetrievalBatcher(retrieve, lambda: 1, 0.0, serial=True)
        first = asyncio.ensure_future(batcher.submit(_request(retriever)))
        await asyncio.sleep(0.01)  # the first batch is out, its retrieval waits at the gate
        second = asyncio.ensure_future(batcher.submit(_request(retriever)))
        other = asyncio.ensure_future(batcher.submit(_request(retriever, k=3)))
        await asyncio.sleep(0.01)
        retrieve.open.set()
        results = await asyncio.gather(first, second, other)
        return retrieve, batcher, results

    retrieve, batcher, (first, second, other) = asyncio.run(scenario())
    assert retrieve.calls == [[("passage", 2, "capital London Jaws")], [("passage", 3, "capital London Jaws")]]
    assert second is first  # the very object the retriever returned
    assert first.ids == retriever.retrieve(["capital London Jaws"], "passage", 2)[0].ids and len(first.ids) == 2
    assert other.ids == retriever.retrieve(["capital London Jaws"], "passage", 3)[0].ids and len(other.ids) == 3
    assert batcher.memo.counts() == {"retrieval_requests": 3, "retrieval_unique": 2, "retrieval_memo_hits": 1,
                                     "retrieval_batch_duplicates": 0}


def test_a_failed_retrieval_fails_its_waiters_and_is_not_remembered():
    retriever = make_retriever()

    async def scenario():
        retrieve = GatedRetrieval()
        retrieve.failing = True
        batcher = RetrievalBatcher(retrieve, lambda: 1, 0.0, serial=True)
        first = asyncio.ensure_future(batcher.submit(_request(retriever)))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(batcher.submit(_request(retriever)))  # waits on the doomed retrieval
        await asyncio.sleep(0.01)
        retrieve.open.set()
        errors = await asyncio.gather(first, second, return_exceptions=True)
        retrieve.failing = False
        again = await batcher.submit(_request(retriever))  # retrieved anew, not the failure replayed
        return retrieve, errors, again

    retrieve, errors, again = asyncio.run(scenario())
    assert all(isinstance(e, ConnectionError) for e in errors)
    assert len(retrieve.calls) == 2 and again.hits


# ----------------------------------------------------------------------------- the rollout loop


class OneAfterAnother(LocalBackend):
    """``LocalBackend`` whose episode i starts generating once episode i-1 is past its first turn
    (its first search answered), so identical searches of the episodes fall in different batches."""

    def __init__(self, engine):
        super().__init__(engine)
        self.turns: dict[str, int] = {}
        self.order: dict[str, int] = {}
        self.past_first_turn: dict[int, asyncio.Event] = defaultdict(asyncio.Event)

    async def generate(self, session_id, context_token_ids, sampling, stop_strings, max_new_tokens):
        turn = self.turns[session_id] = self.turns.get(session_id, -1) + 1
        if turn == 0:
            index = self.order.setdefault(session_id, len(self.order))
            if index > 0:
                await self.past_first_turn[index - 1].wait()
        else:
            self.past_first_turn[self.order[session_id]].set()
        return await super().generate(session_id, context_token_ids, sampling, stop_strings, max_new_tokens)

    def end_session(self, session_id):
        if session_id in self.order:
            self.past_first_turn[self.order[session_id]].set()
        super().end_session(session_id)


@pytest.fixture(scope="module")
def tokenizer():
    return make_engine("scripted", model="smollm2-135m").tokenizer


def _run(rollout, retriever, top_ks=(2,) * G):
    envs = [RagSearchEnv(retriever, [QUESTION], dialect="routerag", top_k=k) for k in top_ks]
    requests = [EpisodeRequest(QUESTION, f"0:{QUESTION.id}", g) for g in range(len(top_ks))]
    return rollout.run_episodes(envs, requests)


def _searches(episodes):
    return [[(t["mode"], t["query"], t["retrieved_ids"], t["retrieved_texts"], t["observation"])
             for t in r.episode["turns"] if t["query"] is not None] for (r,) in episodes]


def test_a_groups_identical_searches_at_different_times_are_retrieved_once(tokenizer):
    retriever = make_retriever()
    engine = make_engine("scripted", tokenizer=tokenizer, script=SEARCH_THEN_ANSWER)
    rollout = MultiTurnRollout(OneAfterAnother(engine), tokenizer, None,
                               RolloutConfig(retrieval_batch_window_s=0.001, **CONFIG))
    episodes = _run(rollout, retriever)

    assert retriever.calls == [((QUESTION.question,), "passage", 2)]  # one retrieval for the four searches
    assert rollout.retrieval_batches == [1]  # the other three never waited for a batch
    assert rollout.retrieval_stats == {"retrieval_requests": 4, "retrieval_unique": 1, "retrieval_memo_hits": 3,
                                       "retrieval_batch_duplicates": 0}
    # what each episode got is what a retrieval of its own returns: the episodes run one per call
    # (so nothing is shared between them) build the same records, token for token
    alone_retriever = make_retriever()
    alone = [MultiTurnRollout(LocalBackend(engine), tokenizer, None, RolloutConfig(**CONFIG)).run_episodes(
        [RagSearchEnv(alone_retriever, [QUESTION], dialect="routerag", top_k=2)], [EpisodeRequest(QUESTION, "0:x", g)])[0]
        for g in range(G)]
    assert len(alone_retriever.calls) == G
    assert _searches(episodes) == _searches(alone)
    assert [[r.token_ids for r in e] for e in episodes] == [[r.token_ids for r in e] for e in alone]
    (expected,) = make_retriever().retrieve([QUESTION.question], "passage", 2)
    assert all(s[0][2] == [h.id for h in expected.hits] and s[0][2] for s in _searches(episodes))

    # the memo is the call's: the next call (the next training step) retrieves again
    _run(rollout, retriever)
    assert retriever.calls == [((QUESTION.question,), "passage", 2)] * 2
    assert rollout.retrieval_stats["retrieval_unique"] == 1 and rollout.retrieval_stats["retrieval_memo_hits"] == 3


def test_searches_in_another_mode_or_with_another_k_are_retrieved_again(tokenizer):
    retriever = make_retriever()
    engine = make_engine("scripted", tokenizer=tokenizer, script=BOTH_MODES)
    rollout = MultiTurnRollout(OneAfterAnother(engine), tokenizer, None,
                               RolloutConfig(retrieval_batch_window_s=0.001, **CONFIG))
    episodes = _run(rollout, retriever, top_ks=(2, 3, 2, 3))

    q = QUESTION.question
    assert sorted((mode, k) for queries, mode, k in retriever.calls for _ in queries) == [
        ("graph", 2), ("graph", 3), ("passage", 2), ("passage", 3)]
    assert all(queries == (q,) for queries, _, _ in retriever.calls)
    stats = rollout.retrieval_stats
    assert stats["retrieval_requests"] == 8 and stats["retrieval_unique"] == 4
    assert stats["retrieval_memo_hits"] + stats["retrieval_batch_duplicates"] == 4
    for (r,), k in zip(episodes, (2, 3, 2, 3)):
        modes = [(t["mode"], len(t["retrieved_ids"])) for t in r.episode["turns"] if t["query"] is not None]
        assert modes == [("passage", k), ("graph", k)]


def test_identical_searches_of_one_batch_are_folded_not_memo_hits(tokenizer):
    retriever = make_retriever()
    engine = make_engine("scripted", tokenizer=tokenizer, script=SEARCH_THEN_ANSWER)
    rollout = MultiTurnRollout(LocalBackend(engine), tokenizer, None, RolloutConfig(retrieval_batch_window_s=10.0, **CONFIG))
    _run(rollout, retriever)
    assert retriever.calls == [((QUESTION.question,), "passage", 2)]
    assert rollout.retrieval_batches == [G]
    assert rollout.retrieval_stats == {"retrieval_requests": 4, "retrieval_unique": 1, "retrieval_memo_hits": 0,
                                       "retrieval_batch_duplicates": 3}


# ----------------------------------------------------------------------------- env runners


def test_group_chunks_keep_every_group_on_one_runner():
    requests = [EpisodeRequest(None, f"0:q{p}", g) for p in range(3) for g in range(4)]
    chunks = group_chunks(requests, 2)
    assert chunks == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7]]
    singles = [EpisodeRequest(None, f"eval:q{i}") for i in range(7)]
    assert group_chunks(singles, 3) == [list(range(7))[i::3] for i in range(3)]  # G = 1: the round robin
    assert group_chunks(requests[:4], 3) == [[0, 1, 2, 3], [], []]
