import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raggym.data import (
    Corpus,
    DataFormatError,
    Passage,
    Question,
    load_corpus,
    load_questions,
    passage_id_for,
    write_corpus,
    write_questions,
)


# ------------------------------------------------------------------ real data


def test_musique_gold_passages_resolve(musique_dir):
    corpus = load_corpus(musique_dir / "corpus.json")
    assert len(corpus) == 1890
    questions = load_questions(musique_dir / "questions.json", corpus)
    assert len(questions) == 60
    gold = [len(q.gold_passage_ids) for q in questions]
    assert all(g >= 2 for g in gold)
    assert sum(gold) / len(gold) == pytest.approx(142 / 60)  # ~2.4 gold passages per question
    for q in questions:
        for pid in q.gold_passage_ids:
            assert pid in corpus
        assert q.hops in (2, 3, 4)
    first = questions[0]
    assert first.id == "2hop__150763_14904"
    assert first.answers == ("G. Stanley Hall", "Stanley Hall")
    titles = [corpus.by_id(pid).title for pid in first.gold_passage_ids]
    assert sorted(titles) == ["Adolescence", "Journal of Psychotherapy Integration"]


def test_hotpotqa_gold_passages_resolve(hotpotqa_dir):
    corpus = load_corpus(hotpotqa_dir / "corpus.json")
    assert len(corpus) == 994
    questions = load_questions(hotpotqa_dir / "questions.json", corpus)
    assert len(questions) == 100
    q = questions[0]
    assert q.id == "5a77ec115542992a6e59dff7"
    assert q.answer == "a spirit"
    assert {corpus.by_id(p).title for p in q.gold_passage_ids} == {"Alû", "Lilu (mythology)"}
    assert all(1 <= len(x.gold_passage_ids) <= 4 for x in questions)


def test_musique_openie_is_aligned_with_corpus(musique_dir):
    corpus = load_corpus(musique_dir / "corpus.json")
    openie = json.loads((musique_dir / "openie_gpt-3.5-turbo-1106.json").read_text())
    assert len(openie["docs"]) == len(corpus)
    for doc, passage in zip(openie["docs"][:50], corpus):
        assert doc["title"] == passage.title and doc["text"] == passage.text


# ------------------------------------------------------------------ corpora


def test_passage_ids_are_content_hashes_and_stable():
    a = passage_id_for("Paris", "Paris is in France.")
    assert a == passage_id_for("Paris", "Paris is in France.")
    assert a != passage_id_for("Paris", "Paris is in Texas.")
    assert a != passage_id_for("Paris ", "Paris is in France.")
    assert a.startswith("p") and len(a) == 17


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_corpus_round_trip(tmp_path, suffix):
    passages = [Passage.from_content(f"T{i}", f"text number {i} — ünïcode") for i in range(5)]
    path = write_corpus(tmp_path / f"c{suffix}", passages)
    back = load_corpus(path)
    assert list(back) == passages
    assert back.index_of(passages[3].id) == 3


def test_corpus_with_explicit_ids_and_duplicate_content(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"id": 7, "title": "A", "text": "x"}\n\n{"title": "B", "text": "y"}\n{"title": "B", "text": "y"}\n')
    c = load_corpus(f)
    assert c.ids[0] == "7" and len(c) == 2  # exact duplicates without ids collapse to one passage


@pytest.mark.parametrize(
    "content, record, field, reason",
    [
        ('[{"title": "A", "text": "x"}, {"title": "B"}]', 1, "text", "missing"),
        ('[{"title": "A", "text": ""}]', 0, "text", "empty"),
        ('[{"title": 3, "text": "x"}]', 0, "title", "expected str"),
        ('[{"title": "A", "text": "x"}, 5]', 1, None, "expected an object"),
        ('{"title": "A"}', None, None, "expected a JSON list"),
        ('[{"title": "A", "text": "x"},', None, None, "malformed JSON"),
        ('[]', None, None, "no passages"),
    ],
)
def test_bad_corpus_errors_name_file_record_field(tmp_path, content, record, field, reason):
    f = tmp_path / "bad.json"
    f.write_text(content)
    with pytest.raises(DataFormatError) as exc:
        load_corpus(f)
    err = exc.value
    assert err.path == str(f) and err.record == record and err.field == field
    assert reason in str(err) and str(f) in str(err)


def test_bad_jsonl_line_and_bad_bytes(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"title": "A", "text": "x"}\n{"title": "B", "text": \n')
    with pytest.raises(DataFormatError, match=r"record 1.*line 2"):
        load_corpus(f)
    g = tmp_path / "bytes.json"
    g.write_bytes(b'[{"title": "A", "text": "\xff\xfe"}]')
    with pytest.raises(DataFormatError, match="not UTF-8"):
        load_corpus(g)
    with pytest.raises(DataFormatError, match="cannot read"):
        load_corpus(tmp_path / "missing.json")


def test_duplicate_explicit_ids_rejected(tmp_path):
    f = tmp_path / "dup.jsonl"
    f.write_text('{"id": "a", "title": "A", "text": "x"}\n{"id": "a", "title": "B", "text": "y"}\n')
    with pytest.raises(DataFormatError, match="record 1.*duplicate id"):
        load_corpus(f)


# ------------------------------------------------------------------ questions


@pytest.fixture
def tiny_corpus():
    return Corpus([Passage.from_content("Alpha", "Alpha is a town. It lies by a river."),
                   Passage.from_content("Beta", "Beta is a river."),
                   Passage.from_content("Gamma", "Gamma is a mountain.")])


def test_hotpot_and_2wiki_and_musique_records(tmp_path, tiny_corpus):
    hotpot = [{"_id": "h1", "question": "Where?", "answer": "Beta", "supporting_facts": [["Alpha", 1], ["Beta", 0]],
               "context": [["Alpha", ["Alpha is a town.", " It lies by a river."]], ["Beta", ["Beta is a river."]]], "type": "bridge"}]
    f = tmp_path / "h.json"
    f.write_text(json.dumps(hotpot))
    (q,) = load_questions(f, tiny_corpus)
    assert q.gold_passage_ids == (tiny_corpus[0].id, tiny_corpus[1].id) and q.kind == "hotpotqa:bridge"

    wiki = [{"_id": "w1", "question": "Which?", "answer": "Gamma", "type": "compositional",
             "supporting_facts": [["Gamma", 0]], "evidences": [["Gamma", "instance of", "mountain"]],
             "context": [["Gamma", ["Gamma is a mountain."]]]}]
    g = tmp_path / "w.json"
    g.write_text(json.dumps(wiki))
    (w,) = load_questions(g, tiny_corpus)
    assert w.kind == "2wiki:compositional" and w.gold_triples == (("Gamma", "instance of", "mountain"),)

    musique = [{"id": "2hop_x", "question": "Q?", "answer": "Beta", "answer_aliases": ["the Beta", "Beta"],
                "paragraphs": [{"title": "Beta", "paragraph_text": "Beta is a river.", "is_supporting": True},
                               {"title": "Gamma", "paragraph_text": "Gamma is a mountain.", "is_supporting": False}]}]
    m = tmp_path / "m.json"
    m.write_text(json.dumps(musique))
    (mq,) = load_questions(m, tiny_corpus)
    assert mq.answers == ("Beta", "the Beta") and mq.gold_passage_ids == (tiny_corpus[1].id,) and mq.hops == 2


def musique_record(decomposition) -> dict:
    return {"id": "2hop_d", "question": "Which river flows past the town by the river?", "answer": "Beta",
            "paragraphs": [{"idx": 0, "title": "Gamma", "paragraph_text": "Gamma is a mountain.", "is_supporting": False},
                           {"idx": 1, "title": "Alpha", "paragraph_text": "Alpha is a town. It lies by a river.", "is_supporting": True},
                           {"idx": 2, "title": "Beta", "paragraph_text": "Beta is a river.", "is_supporting": True}],
            "question_decomposition": decomposition}


def test_musique_decomposition_becomes_the_golden_trajectory(tmp_path, tiny_corpus):
    f = tmp_path / "m.json"
    f.write_text(json.dumps([musique_record([
        {"id": 11, "question": "Alpha >> lies by", "answer": " a river ", "paragraph_support_idx": 1},
        {"id": 12, "question": "Which river is #1 ?", "answer": "Beta", "paragraph_support_idx": 2},
        {"id": 13, "question": "Is #2 longer than #1?", "answer": "yes", "paragraph_support_idx": None},
    ])]))
    (q,) = load_questions(f, tiny_corpus)
    assert q.hops == 3 and q.golden_trajectory == (
        {"query": "Alpha >> lies by", "mode": "passage", "kb": "text", "answer": "a river", "passage_ids": [tiny_corpus[0].id]},
        {"query": "Which river is a river?", "mode": "passage", "kb": "text", "answer": "Beta", "passage_ids": [tiny_corpus[1].id]},
        {"query": "Is Beta longer than a river?", "mode": "passage", "kb": "text", "answer": "yes", "passage_ids": []},
    )
    # The same keys as the synthetic world's golden steps, plus the supporting passages.
    from raggym.data.synthetic import generate_world

    synthetic = generate_world(seed=3, n_entities=60, n_questions=4).questions[0].golden_trajectory[0]
    assert set(q.golden_trajectory[0]) == set(synthetic) | {"passage_ids"}
    assert Question.from_dict(q.as_dict()) == q


@pytest.mark.parametrize(
    "decomposition, field, reason",
    [
        ([{"question": "Which river is #2?", "answer": "Beta"}], "question_decomposition[0].question", "#2 refers to no earlier"),
        ([{"question": "Alpha >> lies by", "answer": ""}], "question_decomposition[0].answer", "missing or empty"),
        ([{"question": "Alpha >> lies by", "answer": "x", "paragraph_support_idx": 9}],
         "question_decomposition[0].paragraph_support_idx", "no paragraph 9"),
        ("one step", "question_decomposition", "expected a list"),
    ],
)
def test_malformed_musique_decomposition_is_reported(tmp_path, tiny_corpus, decomposition, field, reason):
    f = tmp_path / "m.json"
    f.write_text(json.dumps([musique_record(decomposition)]))
    with pytest.raises(DataFormatError) as exc:
        load_questions(f, tiny_corpus)
    assert exc.value.field == field and reason in str(exc.value)


def test_real_musique_golden_trajectories(musique_dir):
    corpus = load_corpus(musique_dir / "corpus.json")
    questions = load_questions(musique_dir / "questions.json", corpus)
    for q in questions:
        assert len(q.golden_trajectory) == q.hops
        for step in q.golden_trajectory:
            assert "#" not in step["query"] and step["answer"] and step["kb"] == "text"
            assert len(step["passage_ids"]) == 1 and step["passage_ids"][0] in q.gold_passage_ids
        assert q.golden_trajectory[-1]["answer"] in q.answers  # the last sub-answer is the answer
    first = questions[0].golden_trajectory
    assert [s["query"] for s in first] == ["What company published Journal of Psychotherapy Integration?",
                                           "Who was the first president of American Psychological Association?"]
    assert [corpus.by_id(s["passage_ids"][0]).title for s in first] == ["Journal of Psychotherapy Integration", "Adolescence"]


def test_searchr1_parquet(tmp_path, tiny_corpus):
    rows = [
        {"data_source": "hotpotqa", "prompt": [{"role": "user", "content": "Where is Alpha?"}],
         "reward_model": {"ground_truth": {"target": ["by a river", "river"]}, "style": "rule"},
         "extra_info": {"index": 4, "supporting_facts": ["Alpha"]}},
    ]
    f = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f)
    (q,) = load_questions(f, tiny_corpus)
    assert q.question == "Where is Alpha?" and q.answers == ("by a river", "river")
    assert q.gold_passage_ids == (tiny_corpus[0].id,) and q.kind == "hotpotqa" and q.id == "4"


def test_native_jsonl_round_trip(tmp_path, tiny_corpus):
    qs = [Question("a", "What?", ("Beta", "B"), (tiny_corpus[1].id,), (("Alpha", "near", "Beta"),), hops=1, kind="single",
                   golden_trajectory=({"query": "q", "mode": "graph"},))]
    path = write_questions(tmp_path / "q.jsonl", qs)
    assert load_questions(path, tiny_corpus) == qs


@pytest.mark.parametrize(
    "record, field, reason",
    [
        ({"id": "a", "question": "Q", "answers": []}, "answers", "no non-empty gold answer"),
        ({"id": "a", "question": "Q", "answers": ["  "]}, "answers", "no non-empty gold answer"),
        ({"id": "a", "answers": ["x"]}, "question", "missing"),
        ({"id": "a", "question": "Q", "answers": ["x"], "gold_passage_ids": ["nope"]}, "gold_passage_ids[0]", "unknown passage id"),
    ],
)
def test_bad_question_records(tmp_path, tiny_corpus, record, field, reason):
    f = tmp_path / "q.jsonl"
    good = {"id": "ok", "question": "Fine?", "answers": ["yes"]}
    f.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataFormatError) as exc:
        load_questions(f, tiny_corpus)
    assert exc.value.record == 1 and exc.value.field == field and reason in str(exc.value)


def test_unknown_supporting_title_is_reported(tmp_path, tiny_corpus):
    f = tmp_path / "h.json"
    f.write_text(json.dumps([{"_id": "h", "question": "Q", "answer": "A", "supporting_facts": [["Nowhere", 0]], "context": []}]))
    with pytest.raises(DataFormatError, match=r"record 0, field 'supporting_facts\[0\]'.*Nowhere"):
        load_questions(f, tiny_corpus)


def test_duplicate_question_ids_rejected(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text('{"id": "a", "question": "Q", "answers": ["x"]}\n{"id": "a", "question": "R", "answers": ["y"]}\n')
    with pytest.raises(DataFormatError, match="duplicate question id"):
        load_questions(f)


def test_writers_are_atomic(tmp_path):
    target = tmp_path / "c.jsonl"
    write_corpus(target, [Passage.from_content("A", "x")])

    def exploding():
        yield Passage.from_content("B", "y")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_corpus(target, exploding())
    assert [p.title for p in load_corpus(target)] == ["A"]  # old file intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]  # no temp file left


_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40).filter(lambda s: s.strip())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=20), _text), min_size=1, max_size=8, unique=True))
def test_jsonl_corpus_round_trip_property(tmp_path_factory, rows):
    d = tmp_path_factory.mktemp("prop")
    passages = [Passage.from_content(t, x) for t, x in rows]
    back = load_corpus(write_corpus(d / "c.jsonl", passages))
    assert list(back) == passages


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash_the_loader(tmp_path_factory, blob):
    f = tmp_path_factory.mktemp("fuzz") / "c.jsonl"
    f.write_bytes(blob)
    try:
        corpus = load_corpus(f)
    except DataFormatError as e:
        assert str(f) in str(e)
    else:
        assert len(corpus) >= 1
