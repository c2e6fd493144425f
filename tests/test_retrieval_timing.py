"""A query's ``seconds`` is its own work: it does not depend on the queries sharing its call."""

from __future__ import annotations

from dataclasses import replace

import pytest

from raggym.retrieval import Retriever, RetrieverConfig

SHORT = "Who founded Lorvan?"  # 19 characters
LONG = "Which river runs through the town where the founder of Lorvan was born?"  # 71 characters


def _with_timing(base: Retriever, timing: str) -> Retriever:
    return Retriever(base.corpus, base.passage_vectors, base.dense, base.graph, embedder=base.embedder,
                     config=replace(base.config, timing=timing))


class WorkClock:
    """Reads the work done instead of the wall: every query text encoded advances it by its length.

    With it a query's time is exact and known by hand, so the test can tell "the query's own
    work" from "an even share of the call's work" without any timing noise.
    """

    def __init__(self, retriever: Retriever):
        self.now = 0.0
        encode = retriever.encode_queries

        def counting_encode(texts):
            self.now += sum(len(t) for t in texts)
            return encode(texts)

        retriever.encode_queries = counting_encode
        retriever.clock = lambda: self.now


@pytest.mark.parametrize("mode", ["passage", "graph", "hybrid"])
def test_a_querys_seconds_do_not_depend_on_its_batch(small_world_retriever, mode):
    assert len(SHORT) == 19 and len(LONG) == 71
    per_query = _with_timing(small_world_retriever, "per_query")
    WorkClock(per_query)
    alone = per_query.retrieve([SHORT], mode, 3)[0].seconds
    shared = per_query.retrieve([SHORT, LONG, LONG], mode, 3)
    assert alone == 19.0 and [r.seconds for r in shared] == [19.0, 71.0, 71.0]

    # The former accounting split the call's work evenly: the short query's time grew with its company.
    batch = _with_timing(small_world_retriever, "batch")
    WorkClock(batch)
    assert batch.retrieve([SHORT], mode, 3)[0].seconds == 19.0
    assert [r.seconds for r in batch.retrieve([SHORT, LONG, LONG], mode, 3)] == [(19 + 71 + 71) / 3] * 3


def test_serving_each_query_alone_returns_what_the_batch_returns(small_world_retriever, small_world):
    queries = [q.question for q in small_world.questions[:6]]
    per_query = _with_timing(small_world_retriever, "per_query")
    batch = _with_timing(small_world_retriever, "batch")
    for mode in ("passage", "graph", "hybrid"):
        alone, together = per_query.retrieve(queries, mode, 3), batch.retrieve(queries, mode, 3)
        assert [r.ids for r in alone] == [r.ids for r in together]
        assert [r.cost for r in alone] == [r.cost for r in together]
        assert all(r.seconds > 0 for r in alone)


def test_timing_is_validated_and_per_query_is_the_default():
    assert RetrieverConfig().timing == "per_query"
    with pytest.raises(ValueError, match="timing must be one of per_query, batch"):
        RetrieverConfig(timing="wall").validate()
