"""LLM OpenIE: lenient parsing, caching and resume, the HippoRAG file format, a real SmolLM2 run."""

from __future__ import annotations

import json

import pytest

from raggym.data import Corpus, Passage
from raggym.openie import LLMOpenIE, OpenIEConfig, parse_entities, parse_triples, run_openie
from raggym.retrieval.graph import KnowledgeGraph
from raggym.retrieval.openie_io import align_openie


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"named_entities": ["Ulm", "Albert Einstein"]}', ["Ulm", "Albert Einstein"]),
        ('Sure, here you go:\n```json\n{"named_entities": ["A", "B", "A"]}\n```', ["A", "B"]),
        ("{'named_entities': ['Lake Vostok', 1996]}", ["Lake Vostok", "1996"]),
        ('{"named_entities": ["Demon Dice", "Fast Forward Games", "Dem', ["Demon Dice", "Fast Forward Games"]),
        ('["Paris", "France"]', ["Paris", "France"]),
        ("I could not find any entities.", []),
        ("", []),
        ('{"named_entities": ["' + "x" * 500 + '", "ok"]}', ["ok"]),  # absurdly long items are dropped
    ],
)
def test_parse_entities(text, expected):
    assert parse_entities(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"triples": [["Ulm", "located in", "Germany"]]}', [("Ulm", "located in", "Germany")]),
        ('noise {"triples": [["a", "b", "c"], ["too", "short"], ["d", 5, "e"], ["a", "b", "c"]]} noise',
         [("a", "b", "c"), ("d", "5", "e")]),
        ('{"triples": [["a", "b", "c"], ["d", "e", "f"], ["g", "h', [("a", "b", "c"), ("d", "e", "f")]),
        ("[['x', 'y', 'z']]", [("x", "y", "z")]),
        ('{"triples": [["", "r", "o"], [null, "r", "o"]]}', []),
        ("no triples here", []),
    ],
)
def test_parse_triples(text, expected):
    assert parse_triples(text) == expected


class ScriptedGenerator:
    """Answers NER prompts with the capitalised words and triple prompts with one triple per entity pair."""

    name = "scripted"

    def __init__(self, fail_after_calls: int | None = None):
        self.calls = 0
        self.prompts = 0
        self.fail_after_calls = fail_after_calls

    def __call__(self, conversations, max_new_tokens):
        if self.fail_after_calls is not None and self.calls >= self.fail_after_calls:
            raise KeyboardInterrupt("simulated crash")
        self.calls += 1
        self.prompts += len(conversations)
        out = []
        for conv in conversations:
            user = conv[-1]["content"]
            if conv[0]["content"].startswith("Read the paragraph and list every named entity"):
                words = sorted({w.strip(".,") for w in user.split() if w[:1].isupper()})
                out.append("Here: " + json.dumps({"named_entities": words}))
            else:
                ents = json.loads(user.split("Named entities: ", 1)[1])["named_entities"]
                triples = [[a, "appears with", b] for a, b in zip(ents, ents[1:])]
                out.append(json.dumps({"triples": triples})[:-3])  # truncated, like a token limit
        return out


def _corpus(n=5):
    return Corpus([Passage.from_content(f"Title{i}", f"Alpha{i} met Beta{i} in Gamma{i}.") for i in range(n)])


def test_pipeline_caches_and_resumes(tmp_path):
    corpus = _corpus(5)
    cache = tmp_path / "openie.jsonl"
    crashing = ScriptedGenerator(fail_after_calls=2)  # NER + triples for the first batch, then crash
    with pytest.raises(KeyboardInterrupt):
        LLMOpenIE(crashing, cache_path=cache, config=OpenIEConfig(batch_size=2)).extract(corpus, show_progress=False)
    assert len(cache.read_text().splitlines()) == 2  # the finished batch survived
    with cache.open("a") as fh:
        fh.write('{"key": "torn line from a cr')  # a crash mid-write
    resumed = ScriptedGenerator()
    result = LLMOpenIE(resumed, cache_path=cache, config=OpenIEConfig(batch_size=2)).extract(corpus, show_progress=False)
    assert resumed.prompts == 2 * 3  # only the 3 passages not yet cached, two prompts each
    assert result[0].entities == ("Alpha0", "Beta0", "Gamma0", "Title0")
    assert ("Alpha0", "appears with", "Beta0") in result[0].triples
    again = ScriptedGenerator()
    assert LLMOpenIE(again, cache_path=cache).extract(corpus, show_progress=False) == result
    assert again.calls == 0  # everything cached


def test_run_openie_writes_a_hipporag_file_that_builds_a_graph(tmp_path):
    corpus = _corpus(4)
    out = run_openie(corpus, tmp_path / "openie.json",
                     extractor=LLMOpenIE(ScriptedGenerator(), cache_path=tmp_path / "c.jsonl"), show_progress=False)
    doc = json.loads(out.read_text())
    assert {"extracted_entities", "extracted_triples", "title", "text", "passage"} <= set(doc["docs"][0])
    alignment = align_openie(out, corpus)
    assert alignment.matched == 4 and alignment.aligned_by == "content"
    kg = KnowledgeGraph.build(alignment.per_passage)
    assert kg.stats["facts"] > 0 and kg.stats["context_edges"] > 0


def test_duplicate_passages_are_extracted_once(tmp_path):
    p = Passage("a", "T", "Same Text here.")
    q = Passage("b", "T", "Same Text here.")
    gen = ScriptedGenerator()
    out = LLMOpenIE(gen, cache_path=tmp_path / "c.jsonl").extract([p, q], show_progress=False)
    assert out[0] == out[1] and gen.prompts == 2


def test_smollm2_end_to_end_on_one_passage(tmp_path):
    """The real default policy through HF generate on CPU; quality is not judged, robustness is."""
    from raggym.openie import HFGenerator

    generator = HFGenerator(spec="smollm2-135m", threads=1)  # the embedded default is installed by `make install`
    passage = Passage.from_content("Lake Vostok", "Lake Vostok is a lake in Antarctica, found by Russian scientists in 1996.")
    extractor = LLMOpenIE(generator, cache_path=tmp_path / "c.jsonl",
                          config=OpenIEConfig(ner_max_new_tokens=16, triple_max_new_tokens=16, batch_size=1))
    (result,) = extractor.extract([passage], show_progress=False)
    assert all(isinstance(e, str) and e for e in result.entities)
    assert all(len(t) == 3 and all(isinstance(x, str) and x for x in t) for t in result.triples)
    assert (tmp_path / "c.jsonl").is_file()
    KnowledgeGraph.build([result])  # whatever came out is usable
