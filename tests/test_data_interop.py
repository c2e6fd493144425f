"""Reading the anchors' own data files unchanged, and writing the verl layout they train on.

The fixtures below are written here, in the exact layouts of the public files (column names,
nesting, arrow types, JSON-string fields), with text of our own. The tests at the end run on the
real files (RouteRAG's RL dev parquet, FlashRAG's NQ sample and corpus sample) when they are
present; see docs/data.md for where they go.
"""

import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raggym.data import Corpus, DataFormatError, Passage, Question, load_corpus, load_questions
from raggym.data import question_from_prompt, write_verl_parquet
from raggym.data.cli import inspect_data_file, main as data_main
from raggym.data.verl import QUESTION_MARKER

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ RouteRAG's RL parquet layout

# RouteRAG's train/RL_dataset/{train,dev}.parquet: these arrow types, in this order.
ROUTERAG_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.struct([("target", pa.list_(pa.string()))])), ("style", pa.string())])),
    ("extra_info", pa.struct([("index", pa.string()), ("original_id", pa.string()), ("split", pa.string()),
                              ("supporting_facts", pa.string())])),
])

INSTRUCTIONS = (
    "Work out the answer step by step. Think inside <think> and </think> whenever new information arrives.\n"
    "1. To look something up, pick a retriever:\n"
    "   - [passage] ranks documents by embedding similarity\n"
    "   - [graph] walks a knowledge graph built from the documents\n"
    "2. Write the query inside <search> and </search>, e.g. <search> [graph] tallest tower in Alpha </search>\n"
    "Results come back inside <information> and </information>. When nothing else is needed, reply with the "
    "answer inside <answer> and </answer>, e.g. <answer> Beta </answer>. "
)

ROUTERAG_ROWS = [  # (original id, question, answers, supporting facts)
    ("a1", "Which river runs past the town that hosts the Alpha lantern fair?", ["Beta"], [["Alpha", 0], ["Beta", 1], ["Beta", 0]]),
    ("a2", "Is Gamma taller than the hill north of Alpha", ["yes"], [["Gamma", 0], ["Alpha", 2]]),
    ("a3", 'What does the "Question: of the Day" column in the Alpha Herald ask?', ["riddles", "a riddle"], [["Delta", 0]]),
]


def routerag_record(n, original_id, question, answers, facts, *, prompt=None):
    return {
        "data_source": "hotpotqa",
        "prompt": prompt if prompt is not None else [{"content": f"{INSTRUCTIONS}Question: {question}\n", "role": "user"}],
        "ability": "fact-reasoning",
        "reward_model": {"ground_truth": {"target": answers}, "style": "rule"},
        "extra_info": {"index": str(n), "original_id": original_id, "split": "dev", "supporting_facts": json.dumps(facts)},
    }


def write_routerag(path, rows=ROUTERAG_ROWS, schema=ROUTERAG_SCHEMA, **overrides):
    records = [routerag_record(n, *row) for n, row in enumerate(rows)]
    for n, prompt in overrides.get("prompts", {}).items():
        records[n]["prompt"] = prompt
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
    return path


@pytest.fixture
def routerag_corpus(tmp_path):
    """RouteRAG's corpus.json layout: a JSON list of {title, text}, one passage per title."""
    passages = [{"title": "Alpha", "text": "Alpha is a river town known for its lantern fair."},
                {"title": "Beta", "text": "The Beta river flows past Alpha."},
                {"title": "Gamma", "text": "Gamma is a hill of 900 metres."},
                {"title": "Delta", "text": "Delta writes the Alpha Herald's riddle column."},
                {"title": "Epsilon", "text": "Epsilon is unrelated."}]
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps(passages, indent=4))
    return path


def test_routerag_parquet_gives_the_question_itself_answers_and_gold(tmp_path, routerag_corpus):
    path = write_routerag(tmp_path / "dev.parquet")
    questions = load_questions(path)  # no corpus: everything but the gold ids
    assert [q.question for q in questions] == [row[1] for row in ROUTERAG_ROWS]
    assert [q.answers for q in questions] == [("Beta",), ("yes",), ("riddles", "a riddle")]
    assert [q.id for q in questions] == ["a1", "a2", "a3"]  # HotpotQA's own ids, not row numbers
    assert all(q.gold_passage_ids == () and q.kind == "hotpotqa" for q in questions)
    first = questions[0]
    assert first.metadata["supporting_titles"] == ["Alpha", "Beta"] and first.hops == 2
    assert first.metadata["prompt"] == [{"content": f"{INSTRUCTIONS}Question: {ROUTERAG_ROWS[0][1]}\n", "role": "user"}]
    assert first.metadata["extra_info"]["original_id"] == "a1" and first.metadata["data_source"] == "hotpotqa"
    assert "<search>" not in first.question and "Question:" not in first.question

    corpus = load_corpus(routerag_corpus)
    resolved = load_questions(path, corpus)
    assert [[corpus.by_id(p).title for p in q.gold_passage_ids] for q in resolved] == [["Alpha", "Beta"], ["Gamma", "Alpha"], ["Delta"]]
    assert [q.question for q in resolved] == [q.question for q in questions]


def test_supporting_titles_missing_or_ambiguous_in_the_corpus_are_reported(tmp_path, routerag_corpus):
    path = write_routerag(tmp_path / "dev.parquet", rows=[("z", "Where?", ["here"], [["Nowhere", 0]])])
    with pytest.raises(DataFormatError) as exc:
        load_questions(path, load_corpus(routerag_corpus))
    assert (exc.value.record, exc.value.field) == (0, "extra_info.supporting_facts[0]")
    assert "'Nowhere' is not in the corpus" in str(exc.value)

    chunked = Corpus([Passage.from_content("Alpha", "first chunk"), Passage.from_content("Alpha", "second chunk")])
    path = write_routerag(tmp_path / "dev2.parquet", rows=[("z", "Where?", ["here"], [["Alpha", 0]])])
    with pytest.raises(DataFormatError, match="matches 2 passages"):
        load_questions(path, chunked)


QUESTION = "Who founded the Alpha lantern fair?"


@pytest.mark.parametrize("prompt", [
    pytest.param([{"role": "user", "content": f"{INSTRUCTIONS}Question: {QUESTION}\n"}], id="chat-list"),
    pytest.param([{"role": "system", "content": "Question: not this one"},
                  {"role": "user", "content": f"{INSTRUCTIONS}\n\nQuestion: {QUESTION}\n"}], id="system-and-user"),
    pytest.param(f"{INSTRUCTIONS}Question: {QUESTION}\n", id="plain-string"),
    pytest.param(json.dumps([{"role": "user", "content": f"{INSTRUCTIONS}Question: {QUESTION}\n"}]), id="json-string"),
    pytest.param(str([{"content": f"{INSTRUCTIONS}Question: {QUESTION}\n", "role": "user"}]), id="python-repr-string"),
    pytest.param(f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{INSTRUCTIONS}Question: {QUESTION}<|im_end|>\n"
                 "<|im_start|>assistant\n", id="chat-template-applied"),
    pytest.param(f"Question: Who built the Beta bridge?\nAnswer: Gamma\n\nQuestion: {QUESTION}\nAnswer:", id="few-shot"),
    pytest.param(f"Answer the following question:\n\n{QUESTION}\n", id="question-on-next-line"),
    pytest.param(f"Decompose it into sub-questions.\n\nOriginal question: {QUESTION}\n", id="r1-router"),
    pytest.param(f"请回答问题。Question：{QUESTION}\n", id="full-width-colon"),
    pytest.param([{"role": "user", "content": [{"type": "text", "text": f"{INSTRUCTIONS}Question: {QUESTION}"}]}], id="content-parts"),
    pytest.param([{"role": "user", "content": QUESTION}], id="bare-question"),
])
def test_question_is_found_in_every_prompt_form(tmp_path, prompt):
    assert question_from_prompt(prompt) == QUESTION
    if isinstance(prompt, str):  # the same through a file whose prompt column is a string
        schema = ROUTERAG_SCHEMA.set(1, pa.field("prompt", pa.string()))
        path = write_routerag(tmp_path / "s.parquet", rows=ROUTERAG_ROWS[:1], schema=schema, prompts={0: prompt})
        assert load_questions(path)[0].question == QUESTION


@pytest.mark.parametrize("prompt", [
    [{"role": "user", "content": INSTRUCTIONS}],  # the question was lost when the file was made
    [{"role": "user", "content": f"{INSTRUCTIONS}Question:\n\n"}],
    [{"role": "assistant", "content": None}],
    [],
])
def test_prompt_without_a_question_is_an_error_naming_file_record_and_field(tmp_path, prompt):
    path = write_routerag(tmp_path / "bad.parquet", prompts={1: prompt})
    with pytest.raises(DataFormatError) as exc:
        load_questions(path)
    assert (exc.value.path, exc.value.record, exc.value.field) == (str(path), 1, "prompt")
    assert "no recognisable question" in str(exc.value)


def test_a_custom_question_marker(tmp_path):
    path = write_routerag(tmp_path / "q.parquet", rows=ROUTERAG_ROWS[:1],
                          prompts={0: [{"role": "user", "content": f"{INSTRUCTIONS}\nQuery >> {QUESTION}\n"}]})
    with pytest.raises(DataFormatError):
        load_questions(path)
    assert load_questions(path, question_marker=r"Query >>")[0].question == QUESTION


def test_searchr1_columns_and_a_mix_of_data_sources(tmp_path):
    """Search-R1's parquet keeps FlashRAG's id/question/golden_answers columns, and its NQ+HotpotQA
    training file repeats ids across the two sources."""
    def row(source, qid, question):
        return {"id": qid, "question": question, "golden_answers": ["x"], "data_source": source,
                "prompt": [{"role": "user", "content": f"{INSTRUCTIONS}Question: {question}?\n"}],
                "ability": "fact-reasoning", "reward_model": {"ground_truth": {"target": ["x", "ex"]}, "style": "rule"},
                "extra_info": {"split": "train", "index": 0}}

    hotpot_row = row("hotpotqa", "train_0", "which x is older")
    hotpot_row["metadata"] = {"type": "comparison", "supporting_facts": {"title": ["Alpha", "Gamma"], "sent_id": [0, 0]}}
    path = tmp_path / "train.parquet"
    nq_row = {**row("nq", "train_0", "who is x"), "metadata": None}
    pq.write_table(pa.Table.from_pylist([hotpot_row, nq_row]), path)  # arrow infers the schema from the first row
    corpus = Corpus([Passage.from_content("Gamma", "Gamma is old."), Passage.from_content("Alpha", "Alpha is older.")])
    hotpot, nq = load_questions(path, corpus)
    assert (nq.id, hotpot.id) == ("nq/train_0", "hotpotqa/train_0")
    assert nq.question == "who is x" and nq.answers == ("x", "ex") and hotpot.kind == "hotpotqa"
    # Search-R1 keeps FlashRAG's metadata column: its supporting facts give the gold passages.
    assert (nq.gold_passage_ids, hotpot.gold_passage_ids) == ((), (corpus[1].id, corpus[0].id))


# ------------------------------------------------------------------ FlashRAG and HippoRAG 2 layouts


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def flashrag_corpus(tmp_path):
    """FlashRAG's corpus JSONL: {id, contents}, the title on the first line, quoted when it needs to be."""
    return write_jsonl(tmp_path / "wiki.jsonl", [
        {"id": "0", "contents": '"Alpha"\nAlpha is a river town. It hosts a lantern fair.'},
        {"id": "1", "contents": '"Beta (river)"\nThe Beta flows past Alpha.'},
        {"id": "2", "contents": '"Beta (river)"\nIts source is on Gamma.'},
        {"id": "3", "contents": '"""Gamma"" Hill"\n"Gamma" Hill is 900 metres high.'},
        {"id": "4", "contents": "Delta\nDelta is a plain."},
    ])


def test_flashrag_corpus_titles_and_texts(flashrag_corpus):
    corpus = load_corpus(flashrag_corpus)
    assert corpus.ids == ["0", "1", "2", "3", "4"]
    assert [p.title for p in corpus] == ["Alpha", "Beta (river)", "Beta (river)", '"Gamma" Hill', "Delta"]
    assert corpus.by_id("1").text == "The Beta flows past Alpha." and corpus.by_id("3").text == '"Gamma" Hill is 900 metres high.'


def test_flashrag_questions_with_and_without_gold_evidence(tmp_path, flashrag_corpus):
    path = write_jsonl(tmp_path / "dev.jsonl", [
        {"id": "test_0", "question": "who hosts the lantern fair", "golden_answers": ["Alpha", "the town of Alpha"]},
        {"id": "dev_7", "question": "Where does the river past Alpha rise?", "golden_answers": ["Gamma"],
         "metadata": {"type": "bridge", "level": "hard",
                      "supporting_facts": {"title": ["Beta (river)", "Beta (river)"], "sent_id": [0, 1]},
                      "context": {"title": ["Beta (river)", "Delta"],
                                  "sentences": [["Its source", " is on Gamma."], ["Delta is a plain."]]}}},
    ])
    plain, multi_hop = load_questions(path)
    assert (plain.id, plain.answers, plain.kind, plain.gold_passage_ids) == ("test_0", ("Alpha", "the town of Alpha"), "flashrag", ())
    assert multi_hop.kind == "flashrag:bridge" and multi_hop.metadata["supporting_titles"] == ["Beta (river)"]
    # Two passages share the title; the context's text picks the right one.
    assert load_questions(path, load_corpus(flashrag_corpus))[1].gold_passage_ids == ("2",)


def test_hipporag2_popqa_and_nq_files(tmp_path):
    """RouteRAG evaluates on HippoRAG 2's popqa.json and nq_rear.json."""
    popqa = write_jsonl(tmp_path / "popqa.jsonl", [{
        "id": 17, "subj": "Alpha", "prop": "occupation", "obj": "ferryman", "question": "What is Alpha's occupation?",
        "possible_answers": '["ferryman", "boatman"]', "o_wiki_title": "Ferryman", "o_aliases": '["boatman", "ferry pilot"]',
        "paragraphs": [{"title": "Alpha", "text": "Alpha rows the ferry.", "is_supporting": True},
                       {"title": "Beta", "text": "Beta is a river.", "is_supporting": False}]}])
    (q,) = load_questions(popqa)
    assert q.id == "17" and q.kind == "popqa" and q.hops == 1
    assert q.answers == ("ferryman", "boatman", "Ferryman", "ferry pilot")
    corpus = Corpus([Passage.from_content("Beta", "Beta is a river."), Passage.from_content("Alpha", "Alpha rows the ferry.")])
    assert load_questions(popqa, corpus)[0].gold_passage_ids == (corpus[1].id,)

    nq = tmp_path / "nq_rear.json"
    nq.write_text(json.dumps([{"question": "who rows the ferry", "reference": ["Alpha"],
                               "contexts": [{"title": "Alpha", "text": "Alpha rows the ferry.", "is_supporting": True},
                                            {"title": "Beta", "text": "Beta is a river.", "is_supporting": False}]}]))
    (n,) = load_questions(nq, corpus)
    assert (n.id, n.answers, n.kind, n.gold_passage_ids) == ("0", ("Alpha",), "nq", (corpus[1].id,))


# ------------------------------------------------------------------ writing the verl layout


def test_verl_writer_round_trips_the_synthetic_world(tmp_path):
    from raggym.data.synthetic import generate_world
    from raggym.protocol import get_dialect

    world = generate_world(seed=3, n_entities=60, n_questions=6)
    path = write_verl_parquet(tmp_path / "train.parquet", world.questions, dialect="routerag", corpus=world.corpus)
    assert load_questions(path, world.corpus) == world.questions  # ids, text, answers, gold, triples, steps

    table = pq.read_table(path)
    assert table.schema.field("prompt").type == pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))
    row = table.slice(3, 1).to_pylist()[0]
    q = world.questions[3]
    assert row["prompt"] == [{"content": get_dialect("routerag").instruction_prompt(q.question), "role": "user"}]
    assert row["reward_model"] == {"ground_truth": {"target": list(q.answers)}, "style": "rule"}
    assert json.loads(row["extra_info"]["supporting_facts"]) == list(dict.fromkeys(world.corpus.by_id(p).title for p in q.gold_passage_ids))

    # A trainer that keeps only verl's columns still reads back: the question comes out of the prompt.
    pq.write_table(table.drop(["id", "question", "golden_answers"]), tmp_path / "verl_only.parquet")
    assert load_questions(tmp_path / "verl_only.parquet", world.corpus) == world.questions


def test_verl_writer_data_sources(tmp_path):
    questions = [Question("h", "Which is older?", ("Alpha",), kind="hotpotqa:comparison"),
                 Question("w", "Who directed it?", ("Beta",), kind="2wiki:compositional"),
                 Question("m", "Where?", ("Gamma",), kind="musique")]
    path = write_verl_parquet(tmp_path / "t.parquet", questions)
    assert pq.read_table(path).column("data_source").to_pylist() == ["hotpotqa", "2wikimultihopqa", "musique"]
    assert load_questions(path) == questions  # raggym's ids are kept, not prefixed by source
    assert pq.read_table(write_verl_parquet(tmp_path / "n.parquet", questions, data_source="nq")).column("data_source").to_pylist() == ["nq"] * 3


# ------------------------------------------------------------------ properties of the prompt parser

_line_breaks = ("Cs", "Cc", "Zl", "Zp")  # Cc holds \n, \r and the other characters str.splitlines splits on
_one_line = st.text(alphabet=st.characters(blacklist_categories=_line_breaks), max_size=60)
# Questions are built partly from pieces that trip naive parsers: the marker itself, tags, colons.
_tricky_piece = st.sampled_from(["Question:", " question : ", "Original question:", "<answer>", "：", "?", "[", "]"])
_question = (st.lists(_one_line | _tricky_piece, max_size=5).map("".join).map(str.strip)
             .filter(lambda q: q and not any(t in q for t in ("<|", "</s>", "<end_of_turn>", "[/INST]"))))


def _no_marker(text: str) -> bool:
    return re.search(QUESTION_MARKER, text) is None


@settings(max_examples=150, deadline=None)
@given(
    earlier_lines=st.lists(st.text(max_size=60), max_size=4),  # may hold few-shot "Question:" lines
    same_line=_one_line.filter(_no_marker),
    marker=st.sampled_from(["Question: ", "Question:", "question : ", "Original question: ", "Question：", "QUESTION:\t"]),
    question=_question,
    later_lines=st.lists(st.text(max_size=60).filter(_no_marker), max_size=3),
    wrap=st.sampled_from(["string", "chat", "json", "repr"]),
)
def test_question_embedded_in_a_template_round_trips(earlier_lines, same_line, marker, question, later_lines, wrap):
    text = "\n".join([*earlier_lines, f"{same_line} {marker}{question}", *later_lines])
    chat = [{"role": "system", "content": "Question: a decoy in the system message"}, {"role": "user", "content": text}]
    prompt = {"string": text, "chat": chat, "json": json.dumps(chat), "repr": repr(chat)}[wrap]
    assert question_from_prompt(prompt) == question


_json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["role", "content", "text", "type"]), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(prompt=_json_like | _json_like.map(json.dumps) | _json_like.map(repr) | st.text(max_size=200))
def test_prompt_parser_never_crashes(prompt):
    found = question_from_prompt(prompt)
    assert found is None or (isinstance(found, str) and found == found.strip() and found and len(found.splitlines()) == 1)


# ------------------------------------------------------------------ raggym data inspect


def test_inspect_reports_format_counts_gold_and_samples(tmp_path, routerag_corpus, capsys):
    path = write_routerag(tmp_path / "dev.parquet")
    report = inspect_data_file(path)
    assert (report["format"], report["kind"], report["questions"]) == ("searchr1", "questions", 3)
    assert (report["with_gold_passages"], report["gold_named_by_title_unresolved"]) == (0, 3)
    assert [s["question"] for s in report["samples"]] == [row[1] for row in ROUTERAG_ROWS]

    assert data_main(["inspect", str(path), "--corpus", str(routerag_corpus), "--json", "--samples", "1"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert (resolved["with_gold_passages"], resolved["gold_named_by_title_unresolved"]) == (3, 0)
    assert resolved["samples"] == [{"id": "a1", "question": ROUTERAG_ROWS[0][1], "answers": ["Beta"], "kind": "hotpotqa",
                                    "hops": 2, "gold_passage_ids": resolved["samples"][0]["gold_passage_ids"],
                                    "gold_titles": ["Alpha", "Beta"], "supporting_titles": ["Alpha", "Beta"]}]

    assert data_main(["inspect", str(routerag_corpus)]) == 0
    text = capsys.readouterr().out
    assert "format:  hipporag (corpus)" in text and "passages: 5 (5 distinct titles)" in text


def test_inspect_fails_with_the_loaders_error(tmp_path, capsys):
    path = write_routerag(tmp_path / "bad.parquet", prompts={2: [{"role": "user", "content": INSTRUCTIONS}]})
    assert data_main(["inspect", str(path)]) == 2
    assert f"{path}, record 2, field 'prompt'" in capsys.readouterr().err


# ------------------------------------------------------------------ the real public files

# These tests read public files raggym may not redistribute; they carry the `public_data` marker, which
# `make test` deselects, and run with `pytest -m public_data` where RAGGYM_INTEROP_DATA points at them.
INTEROP_DATA = Path(os.environ.get("RAGGYM_INTEROP_DATA", REPO.parent / "shared" / "data" / "interop"))


def real_file(relative: str) -> Path:
    path = INTEROP_DATA / relative
    if not path.is_file():
        pytest.skip(f"{path} is absent: the public file is not redistributed with raggym (docs/data.md says where to get it)")
    return path


@pytest.mark.public_data
def test_real_routerag_dev_parquet():
    questions = load_questions(real_file("routerag/dev.parquet"))
    reference = json.loads(real_file("routerag/hotpotqa_dev_queries.json").read_text())  # the same 100 questions, plain
    assert len(questions) == len(reference) == 100
    for q, ref in zip(questions, reference):
        # RouteRAG appended "?" to the four questions that lacked one when it built the prompts.
        assert q.question in (ref["question"], ref["question"].strip() + "?")
        assert q.id == ref["_id"] and q.answers == (ref["answer"],) and q.kind == "hotpotqa"
        assert q.metadata["supporting_titles"] == list(dict.fromkeys(f[0] for f in ref["supporting_facts"]))
        assert q.metadata["prompt"][0]["content"].endswith(f"Question: {q.question}\n")
    assert sum(q.question == ref["question"] for q, ref in zip(questions, reference)) == 96


@pytest.mark.public_data
def test_real_routerag_dev_parquet_resolves_against_its_corpus():
    corpus = load_corpus(real_file("routerag/corpus.json"))
    questions = load_questions(real_file("routerag/dev.parquet"), corpus)
    assert all(len(q.gold_passage_ids) == len(q.metadata["supporting_titles"]) for q in questions)


@pytest.mark.public_data
def test_real_routerag_train_rows_match_the_hotpotqa_loader(tmp_path, hotpotqa_dir):
    """Nine of the shared HotpotQA questions are in RouteRAG's training file; read both ways, they agree."""
    import pyarrow.compute as pc

    corpus = load_corpus(hotpotqa_dir / "corpus.json")
    hotpot = {q.id: q for q in load_questions(hotpotqa_dir / "questions.json", corpus)}
    table = pq.read_table(real_file("routerag/train.parquet"))
    shared = table.filter(pc.is_in(pc.struct_field(table["extra_info"], "original_id"), value_set=pa.array(list(hotpot))))
    pq.write_table(shared, tmp_path / "shared_rows.parquet")
    questions = load_questions(tmp_path / "shared_rows.parquet", corpus)
    assert len(questions) == 9
    for q in questions:
        expected = hotpot[q.id]
        assert (q.question, q.answers) == (expected.question, expected.answers)
        assert set(q.gold_passage_ids) == set(expected.gold_passage_ids)


@pytest.mark.public_data
def test_real_routerag_popqa_test_set():
    raw = json.loads(real_file("routerag/popqa.json").read_text())
    questions = load_questions(real_file("routerag/popqa.json"))
    assert len(questions) == len(raw) == 1000 and questions[0].question == "What is George Rankin's occupation?"
    for q, rec in zip(questions, raw):
        assert q.id == str(rec["id"]) and q.answers[0] == rec["obj"].strip()
        assert set(json.loads(rec["possible_answers"])) <= set(q.answers)
        assert len(q.gold_passage_ids) == sum(1 for p in rec["paragraphs"] if p["is_supporting"]) >= 1


@pytest.mark.public_data
def test_real_flashrag_nq_sample_and_corpus_sample():
    questions = load_questions(real_file("flashrag/nq/test.jsonl"))
    assert len(questions) == 17 and questions[0].id == "test_0"
    assert questions[6].answers == ("Xiu Li Dai", "Dai Xiuli", "Dai Yongge", "Yongge Dai")
    corpus = load_corpus(real_file("flashrag/sample_data.jsonl"))
    assert len(corpus) == 1000 and corpus.by_id("0").title == "Evan Morris"
    assert corpus.by_id("0").text.startswith("Evan Morris Evan L. Morris (January 26, 1977")
    assert not any(p.title.startswith('"') or "\n" in p.title for p in corpus)
