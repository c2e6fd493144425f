"""Golden trajectories derived from real datasets' evidence, and GraphRAG-R1's cold start on them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from raggym.data import (
    Corpus,
    GoldenTrajectoryError,
    Passage,
    Question,
    golden_trajectory_for,
    load_corpus,
    load_questions,
    with_golden_trajectories,
)

ALPHA = Passage.from_content("Alpha", "Alpha is a town. It lies by the river Beta.")
BETA = Passage.from_content("Beta", "Beta is a river that rises in the Gamma mountains.")
GAMMA = Passage.from_content("Gamma", "Gamma is a mountain range.")
CORPUS = Corpus([ALPHA, BETA, GAMMA])


def _load(tmp_path, records, name):
    path = tmp_path / name
    path.write_text(json.dumps(records))
    return load_questions(path, CORPUS)


def test_hotpotqa_supporting_facts_give_one_title_search_per_gold_passage(tmp_path):
    # supporting_facts name Alpha first, then Beta: the steps search for those titles in that order
    (q,) = _load(tmp_path, [{
        "_id": "h1", "question": "Which river flows by Alpha?", "answer": "Beta", "type": "bridge",
        "supporting_facts": [["Alpha", 1], ["Beta", 0]],
        "context": [["Alpha", ["Alpha is a town.", " It lies by the river Beta."]],
                    ["Beta", ["Beta is a river that rises in the Gamma mountains."]]]}], "h.json")
    assert q.golden_trajectory == ()
    assert golden_trajectory_for(q, CORPUS) == (
        {"query": "Alpha", "mode": "passage", "kb": "text", "answer": None, "passage_ids": [ALPHA.id]},
        {"query": "Beta", "mode": "passage", "kb": "text", "answer": None, "passage_ids": [BETA.id]},
    )
    with pytest.raises(GoldenTrajectoryError, match=r"'h1' \(hotpotqa\).*no corpus was given"):
        golden_trajectory_for(q)


def test_2wiki_evidences_give_one_relation_question_per_triple(tmp_path):
    (q,) = _load(tmp_path, [{
        "_id": "w1", "question": "Where does the river by Alpha rise?", "answer": "Gamma", "type": "compositional",
        "supporting_facts": [["Alpha", 1], ["Beta", 0]],
        "evidences": [["Alpha", "located next to body of water", "Beta"], ["Beta", "source", "Gamma"]],
        "context": [["Alpha", ["Alpha is a town.", " It lies by the river Beta."]],
                    ["Beta", ["Beta is a river that rises in the Gamma mountains."]]]}], "w.json")
    assert golden_trajectory_for(q, CORPUS) == (
        {"query": "located next to body of water of Alpha", "mode": "passage", "kb": "text", "answer": "Beta",
         "passage_ids": [ALPHA.id]},
        {"query": "source of Beta", "mode": "passage", "kb": "text", "answer": "Gamma", "passage_ids": [BETA.id]},
    )
    # without the corpus the steps stand, only their passages are unknown
    assert [s["passage_ids"] for s in golden_trajectory_for(q)] == [[], []]


def test_musique_decomposition_is_kept_as_the_loader_wrote_it(tmp_path):
    (q,) = _load(tmp_path, [{
        "id": "2hop_1", "question": "Where does the river by Alpha rise?", "answer": "Gamma",
        "paragraphs": [{"idx": 0, "title": "Alpha", "paragraph_text": ALPHA.text, "is_supporting": True},
                       {"idx": 1, "title": "Beta", "paragraph_text": BETA.text, "is_supporting": True}],
        "question_decomposition": [
            {"question": "Which river lies by Alpha?", "answer": "Beta", "paragraph_support_idx": 0},
            {"question": "Where does #1 rise?", "answer": "Gamma", "paragraph_support_idx": 1}]}], "m.json")
    steps = golden_trajectory_for(q, CORPUS)
    assert steps == q.golden_trajectory
    assert [s["query"] for s in steps] == ["Which river lies by Alpha?", "Where does Beta rise?"]
    # a MuSiQue record without a decomposition falls back to its is_supporting paragraphs
    bare = replace(q, golden_trajectory=())
    assert [s["query"] for s in golden_trajectory_for(bare, CORPUS)] == ["Alpha", "Beta"]


def test_records_without_evidence_are_refused_with_the_dataset_and_what_is_missing():
    nq = Question("nq-7", "Who wrote Beta?", ("X",), kind="nq")
    with pytest.raises(GoldenTrajectoryError, match=r"'nq-7' \(nq\): cannot derive.*question_decomposition.*"
                                                    r"evidences.*supporting_facts"):
        golden_trajectory_for(nq, CORPUS)
    # a batch names how many fail and which
    fine = Question("h2", "Q?", ("Beta",), gold_passage_ids=(BETA.id,), kind="hotpotqa:bridge")
    with pytest.raises(GoldenTrajectoryError, match=r"1 of 2 questions have no golden trajectory: question 'nq-7'"):
        with_golden_trajectories([fine, nq], CORPUS)
    # steps without intermediate answers do not suit R1-Router's scored answer steps
    with pytest.raises(GoldenTrajectoryError, match="'h2' .*no intermediate answers"):
        with_golden_trajectories([fine], CORPUS, need_answers=True)
    (filled,) = with_golden_trajectories([fine], CORPUS)
    assert filled.golden_trajectory[0]["query"] == "Beta" and filled.id == "h2"


def test_graphrag_r1_cold_start_plays_steps_derived_from_gold_passages(small_world, small_world_retriever):
    """The synthetic questions with their own steps removed stand for HotpotQA-style records."""
    from experiments.recipe.sft import golden_examples
    from raggym.models import load_policy_tokenizer

    tokenizer = load_policy_tokenizer("smollm2-135m")
    chosen = [q for q in small_world.questions if q.kind == "bridge" and q.hops == 2][:2]
    stripped = [replace(q, golden_trajectory=(), gold_triples=()) for q in chosen]
    examples = golden_examples(stripped, small_world_retriever, "graphrag_r1", tokenizer, max_observation_tokens=64,
                               show_progress=False)
    for q, ex in zip(stripped, examples):
        titles = [small_world_retriever.corpus.by_id(pid).title for pid in q.gold_passage_ids]
        assert ex["num_searches"] == len(q.gold_passage_ids)
        for title in titles:
            assert f"<|begin_of_query|> {title} <|end_of_query|>" in ex["text"]
        assert f"<answer> {q.answer} </answer>" in ex["text"] and ex["gold_hit"]
        assert ex["reward"] > 0  # the terminal reward of a well-formed episode


@pytest.mark.integration  # builds a real index with its knowledge graph: about a minute on two cores
def test_graphrag_r1_cold_start_on_musique_sub(musique_dir, tmp_path):
    """Real MuSiQue records (their own paragraphs as the corpus) through GraphRAG-R1's golden episodes."""
    from experiments.recipe.sft import golden_examples
    from raggym.models import load_policy_tokenizer
    from raggym.retrieval import Retriever

    root = musique_dir
    records = json.loads((root / "questions.json").read_text())[:2]
    paragraphs = {(p["title"], p["paragraph_text"]) for r in records for p in r["paragraphs"]}
    (tmp_path / "corpus.json").write_text(json.dumps([{"title": t, "text": x} for t, x in sorted(paragraphs)]))
    (tmp_path / "questions.json").write_text(json.dumps(records))
    corpus = load_corpus(tmp_path / "corpus.json")
    questions = load_questions(tmp_path / "questions.json", corpus)
    # the shipped OpenIE docs of these paragraphs only (the file covers the whole musique_sub corpus)
    docs = json.loads((root / "openie_gpt-3.5-turbo-1106.json").read_text())["docs"]
    openie = {"docs": [d for d in docs if (d["title"], d["text"]) in paragraphs]}
    retriever = Retriever.build(corpus, openie=openie, cache=False, show_progress=False)
    examples = golden_examples(questions, retriever, "graphrag_r1", load_policy_tokenizer("smollm2-135m"),
                               max_observation_tokens=64, show_progress=False)
    for record, q, ex in zip(records, questions, examples):
        assert ex["num_searches"] == len(record["question_decomposition"]) == len(q.golden_trajectory)
        assert f"<|begin_of_query|> {q.golden_trajectory[0]['query']} <|end_of_query|>" in ex["text"]
        assert f"<answer> {q.answer} </answer>" in ex["text"]
