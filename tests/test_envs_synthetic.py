"""End-to-end episodes on the synthetic world, with scripted actions.

* RagSearchEnv with the real ``raggym.retrieval.Retriever``: search in graph mode, then answer.
* MultiKBRouteEnv over the world's text and table knowledge bases (comparison questions whose
  years live only in the table KB), with the keyword test retriever per knowledge base.
"""

from __future__ import annotations

import pytest

from envs import MultiKBRouteEnv, RagSearchEnv
from test_envs_support import KeywordRetriever


@pytest.fixture(scope="module")
def table_world():
    from raggym.data.synthetic import generate_world

    return generate_world(seed=11, n_entities=300, n_questions=80, attribute_kb="table", comparison_share=0.4)


@pytest.fixture(scope="module")
def real_retriever(small_world_retriever):
    return small_world_retriever


def test_graph_search_then_answer_with_the_real_retriever(small_world, real_retriever):
    question = next(q for q in small_world.questions if q.kind == "single")
    query = question.golden_trajectory[0]["query"]
    expected = real_retriever.retrieve([query], "graph", 3)[0]

    env = RagSearchEnv(real_retriever, small_world.questions, "routerag", corpus=small_world.corpus)
    env.reset(seed=0, options={"question": question})
    obs, reward, terminated, truncated, info = env.step(
        f"<think>I should look this up in the graph.</think>\n<search> [graph] {query} </search>"
    )
    assert not (terminated or truncated) and not info["format_error"]
    assert info["mode"] == "graph" and info["query"] == query
    assert list(info["retrieved_ids"]) == expected.ids
    assert info["retrieval_cost"] == expected.cost  # deterministic work count
    assert question.gold_passage_ids[0] in info["retrieved_ids"]
    assert question.answer in obs

    obs, reward, terminated, truncated, info = env.step(
        f"<think>The passage states it.</think>\n<answer> {question.answer} </answer>"
    )
    assert terminated and reward == 1.0
    record = info["episode"]
    assert record.all_retrieved_ids() == expected.ids
    assert record.retrieval_cost == expected.cost and record.num_retrievals == 1
    assert record.gold_passages and record.format_check().ok


def test_multi_kb_episode_on_the_synthetic_table_world(table_world):
    assert table_world.table_corpus is not None and len(table_world.table_corpus) > 0
    text = KeywordRetriever(table_world.corpus)
    tables = KeywordRetriever(table_world.table_corpus)
    env = MultiKBRouteEnv(
        {"Text Retriever": text, "Table Retriever": tables},
        table_world.questions,
        gold_knowledge_base_names={"text": "Text Retriever", "table": "Table Retriever"},
        corpus=table_world.table_corpus,
    )
    question = next(q for q in table_world.questions if q.kind == "comparison")
    env.reset(seed=0, options={"question": question})
    for step in question.golden_trajectory:
        assert step["kb"] == "table"
        obs, reward, terminated, truncated, info = env.step(
            f"<think>Years are kept in tables.</think><sub-question>{step['query']}</sub-question><ret>Table Retriever</ret>"
        )
        assert info["knowledge_base"] == "Table Retriever" and not info["format_error"]
        assert list(info["retrieved_ids"]) == tables.retrieve([step["query"]], "passage", 3)[0].ids
        assert step["answer"] in obs  # the year is in this step's documents
        env.step(f"<think>The table lists it.</think><answer>{step['answer']}</answer>")
    env.step("<think>Both years are known.</think><sub-question>None</sub-question><ret>None</ret>")
    obs, reward, terminated, truncated, info = env.step(f"<think>Compare the years.</think><answer>{question.answer}</answer>")
    assert terminated and reward == 1.0
    record = info["episode"]
    routes = record.retrieval_steps()
    assert [s.gold_knowledge_base for s in routes] == ["Table Retriever", "Table Retriever"]
    assert [s.knowledge_base for s in routes] == [s.gold_knowledge_base for s in routes]
    assert set(question.gold_passage_ids) <= {pid for s in routes for pid in s.retrieved_ids}
    assert record.retrieval_cost == 2 * len(table_world.table_corpus)
    assert len(record.gold_passages) == len(question.gold_passage_ids)
    assert len(text.calls) == 0


def test_step_batch_with_the_real_retriever_matches_single_steps(small_world, real_retriever):
    from envs import step_batch

    questions = [q for q in small_world.questions if q.golden_trajectory][:6]
    modes = ["graph", "passage", "hybrid"]
    segments = [
        f"<think>Look it up.</think><search> [{'graph][passage' if modes[i % 3] == 'hybrid' else modes[i % 3]}] {q.golden_trajectory[0]['query']} </search>"
        for i, q in enumerate(questions)
    ]
    batch = [RagSearchEnv(real_retriever, small_world.questions) for _ in questions]
    for env, q in zip(batch, questions):
        env.reset(options={"question": q})
    batched = step_batch(batch, segments)
    for q, segment, result in zip(questions, segments, batched):
        solo = RagSearchEnv(real_retriever, small_world.questions)
        solo.reset(options={"question": q})
        obs, reward, terminated, truncated, info = solo.step(segment)
        assert result.observation == obs
        assert result.info["retrieved_ids"] == info["retrieved_ids"]
        assert result.info["retrieval_cost"] == info["retrieval_cost"]
    assert [r.info["mode"] for r in batched] == [modes[i % 3] for i in range(len(questions))]
