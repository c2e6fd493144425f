import json
import re

import pytest

from raggym.data import load_corpus, load_questions
from raggym.data.synthetic import RELATIONS, WorldConfig, SyntheticWorld, generate_world, write_world


def test_same_seed_same_world_different_seed_different_world():
    a, b = generate_world(3, n_entities=200, n_questions=30), generate_world(3, n_entities=200, n_questions=30)
    assert a.corpus.ids == b.corpus.ids
    assert [q.as_dict() for q in a.questions] == [q.as_dict() for q in b.questions]
    assert a.openie == b.openie
    c = generate_world(4, n_entities=200, n_questions=30)
    assert c.corpus.ids != a.corpus.ids


def _gold_texts(world, q):
    kbs = world.knowledge_bases()
    out = []
    for pid in q.gold_passage_ids:
        p = next(kb.get(pid) for kb in kbs.values() if kb.get(pid) is not None)
        out.append(p.text)
    return out


def test_every_answer_occurs_in_a_gold_passage(small_world):
    for q in small_world.questions:
        texts = _gold_texts(small_world, q)
        assert any(q.answer in t for t in texts), (q.question, q.answer, texts)


def test_every_question_is_answerable_by_following_its_gold_passages(small_world):
    """Walk the golden trajectory: each hop's answer must be stated in a gold passage next to the
    entity the hop asks about (by the name the agent has at that point)."""
    for q in small_world.questions:
        texts = _gold_texts(small_world, q)
        if q.kind == "comparison":
            for step in q.golden_trajectory:
                subject = step["query"].split(" of ", 1)[1]
                assert any(subject in t and step["answer"] in t for t in texts)
            years = [int(s["answer"]) for s in q.golden_trajectory]
            assert years[0] != years[1]
            continue
        subject = q.gold_triples[0][0]
        assert subject in q.question
        for triple, step in zip(q.gold_triples, q.golden_trajectory):
            assert triple[0] == subject or step["mode"] == "graph"
            # the passage stating this hop names the canonical subject and the surfaced answer
            assert any(triple[0] in t and step["answer"] in t for t in texts), (q.question, triple, step, texts)
            subject = triple[2]
        assert q.golden_trajectory[-1]["answer"] == q.answer == q.gold_triples[-1][2]


def test_hop_counts_match_paths(small_world):
    kinds = set()
    for q in small_world.questions:
        kinds.add(q.kind)
        if q.kind == "comparison":
            assert q.hops == 2 and len(q.gold_triples) == 2 and len(q.gold_passage_ids) in (1, 2)
        else:
            assert q.hops == len(q.gold_triples) == len(q.golden_trajectory)
            assert 1 <= q.hops <= 4
            assert (q.kind == "single") == (q.hops == 1)
            # consecutive triples chain: the object of hop i is the subject of hop i+1
            for left, right in zip(q.gold_triples, q.gold_triples[1:]):
                assert left[2] == right[0]
            assert len(q.gold_passage_ids) == q.hops  # one fact per hop, each in its own entity's passage
    assert kinds == {"single", "bridge", "comparison"}


def test_max_hops_knob_and_question_mix():
    w = generate_world(1, n_entities=200, n_questions=80, max_hops=2, comparison_share=0.0)
    assert {q.hops for q in w.questions} <= {1, 2}
    assert all(q.kind != "comparison" for q in w.questions)


def test_alias_facts_are_reachable_only_through_the_graph():
    w = generate_world(2, n_entities=300, n_questions=120, alias_share=1.0, comparison_share=0.0, max_hops=3)
    multi = [q for q in w.questions if q.hops > 1]
    assert multi and all(q.golden_trajectory[1]["mode"] == "graph" for q in multi)
    alias_triples = [t for d in w.openie["docs"] for t in d["extracted_triples"] if t[1] == "is alias of"]
    assert alias_triples
    corpus_text = "\n".join(p.text for p in w.corpus)
    for alias, _, canonical in alias_triples[:50]:
        assert alias in corpus_text
        # no passage links the alias to the canonical name: only the graph does
        assert not any(alias in p.text and canonical in p.text for p in w.corpus)
    assert w.stats()["graph_only_hops"] >= len(multi)


def test_distractor_knob_scales_passages():
    none = generate_world(5, n_entities=200, distractors_per_fact=0.0).stats()["passages"]
    two = generate_world(5, n_entities=200, distractors_per_fact=2.0).stats()["passages"]
    assert two == pytest.approx(3 * none, rel=0.05)


def test_openie_file_format_matches_hipporag(small_world):
    docs = small_world.openie["docs"]
    assert len(docs) == len(small_world.corpus)
    for doc, p in zip(docs, small_world.corpus):
        assert doc["title"] == p.title and doc["text"] == p.text and doc["passage"] == f"{p.title}\n{p.text}"
        assert all(isinstance(t, list) and len(t) == 3 for t in doc["extracted_triples"])
        for s, _, o in doc["extracted_triples"]:
            assert s in doc["extracted_entities"] and o in doc["extracted_entities"]


def test_table_kb():
    w = generate_world(6, n_entities=200, n_questions=60, attribute_kb="table", comparison_share=0.5)
    assert w.table_corpus is not None and len(w.table_corpus) > 0
    assert not any(re.search(r"\bwas born in the year\b", p.text) for p in w.corpus)
    comps = [q for q in w.questions if q.kind == "comparison"]
    assert comps
    for q in comps:
        assert all(s["kb"] == "table" for s in q.golden_trajectory)
        assert all(pid in w.table_corpus for pid in q.gold_passage_ids)
        assert any(q.answer in w.table_corpus.by_id(pid).text for pid in q.gold_passage_ids)
    t = w.table_corpus[0].text
    assert t.startswith("Table: ") and "Columns: name |" in t and "Rows: " in t


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_written_world_reads_back_with_the_loaders(tmp_path, fmt):
    cfg = WorldConfig(seed=9, n_entities=150, n_questions=25, attribute_kb="table")
    stats = write_world(cfg, tmp_path / "w", corpus_format=fmt)
    corpus = load_corpus(tmp_path / "w" / f"corpus.{fmt}")
    tables = load_corpus(tmp_path / "w" / "tables.jsonl")
    in_memory = SyntheticWorld(cfg)
    assert corpus.ids == in_memory.corpus.ids and tables.ids == in_memory.table_corpus.ids
    merged = type(corpus)(list(corpus) + list(tables))
    questions = load_questions(tmp_path / "w" / "questions.jsonl", merged)
    assert [q.as_dict() for q in questions] == [q.as_dict() for q in in_memory.questions]
    openie = json.loads((tmp_path / "w" / "openie.json").read_text())
    assert openie == in_memory.openie
    assert stats["passages"] == len(corpus) and json.loads((tmp_path / "w" / "world.json").read_text())["stats"]["questions"] == 25
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]  # temp dir renamed away


def test_config_validation():
    for bad in ({"max_hops": 5}, {"n_entities": 10}, {"alias_share": 1.5}, {"attribute_kb": "image"}, {"distractors_per_fact": -1}):
        with pytest.raises(ValueError):
            WorldConfig(**bad)


def test_relations_are_functional(small_world):
    E = small_world.entities
    for rel, (st, ot) in RELATIONS.items():
        objs = E.relation[rel]
        assert len(objs) == len(E.ids_by_type[st])
        assert set(E.type_of[int(o)] for o in objs) == {ot}
