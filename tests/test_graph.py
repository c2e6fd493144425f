"""Knowledge graph construction, OpenIE alignment, query seeding and persistence."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from raggym.data import Corpus, Passage
from raggym.retrieval.graph import GraphConfig, KnowledgeGraph, min_max, normalize_phrase
from raggym.retrieval.openie_io import PassageTriples, align_openie, openie_docs
from raggym.retrieval.storage import IndexFormatError


class TableEmbedder:
    """Returns fixed vectors for known texts (so cosines are chosen by the test)."""

    dim = 3
    name = spec = "table-embedder"

    def __init__(self, table: dict[str, list[float]]):
        self.table = {k: np.asarray(v, np.float32) / np.linalg.norm(v) for k, v in table.items()}

    def encode(self, texts, **_):
        default = np.array([0.0, 0.0, 1.0], np.float32)
        return np.stack([self.table.get(t, default) for t in texts]) if texts else np.zeros((0, 3), np.float32)


def test_normalize_phrase():
    assert normalize_phrase("  Ulm, Germany. ") == "ulm germany"
    assert normalize_phrase("Saint-Étienne") == "saint étienne"
    assert normalize_phrase("__init__") == "init"
    assert normalize_phrase("?!") == ""


def test_min_max_constant_row_is_all_ones():
    np.testing.assert_allclose(min_max(np.array([[1.0, 3.0, 2.0], [5.0, 5.0, 5.0]])), [[0, 1, 0.5], [1, 1, 1]])


def small_triples():
    return [
        PassageTriples(("Ulm",), (("Albert Einstein", "born in", "Ulm"), ("Ulm", "located in", "Germany"))),
        PassageTriples((), (("Einstein", "worked at", "Patent Office"), ("Albert Einstein", "born in", "Ulm"))),
        PassageTriples(("Bern",), ()),
        PassageTriples((), (("", "is", "nothing"), ("Germany", "is", "Germany"))),
    ]


def test_structure_by_hand():
    kg = KnowledgeGraph.build(small_triples(), config=GraphConfig(include_entities=True))
    # phrases in first-appearance order
    assert kg.phrases == ["albert einstein", "ulm", "germany", "einstein", "patent office", "bern"]
    P = 4
    node = {p: P + i for i, p in enumerate(kg.phrases)}
    assert kg.n_nodes == 10
    assert kg.facts == [
        ("albert einstein", "born in", "ulm"),
        ("ulm", "located in", "germany"),
        ("einstein", "worked at", "patent office"),
        ("germany", "is", "germany"),
    ]
    dense_adj = np.zeros((10, 10))
    for i in range(10):
        for j, w in zip(kg.csr.indices[kg.csr.indptr[i] : kg.csr.indptr[i + 1]], kg.csr.weights[kg.csr.indptr[i] : kg.csr.indptr[i + 1]]):
            dense_adj[i, j] = w
    np.testing.assert_allclose(dense_adj, dense_adj.T)
    # relation edge: "albert einstein born in ulm" occurs twice
    assert dense_adj[node["albert einstein"], node["ulm"]] == 2.0
    assert dense_adj[node["ulm"], node["germany"]] == 1.0
    assert dense_adj[node["germany"], node["germany"]] == 0.0  # self-relation adds no edge
    # context edges
    assert dense_adj[0, node["ulm"]] == 1.0 and dense_adj[0, node["germany"]] == 1.0
    assert dense_adj[2, node["bern"]] == 1.0  # NER-only entity still linked to its passage
    assert dense_adj[3, node["germany"]] == 1.0
    assert dense_adj[0, 1] == 0.0  # passages never link directly
    np.testing.assert_array_equal(kg.phrase_passage_count, [2, 2, 2, 1, 1, 1])
    assert kg.stats["dropped_triples"] == 1  # the triple with an empty subject
    assert kg.stats["synonymy_edges"] == 0 and kg.fact_embeddings is None

    without_ner = KnowledgeGraph.build(small_triples(), config=GraphConfig(include_entities=False))
    assert "bern" not in without_ner.phrases


def test_synonymy_edges_use_threshold():
    per_passage = [PassageTriples((), (("New York City", "is in", "USA"),)), PassageTriples((), (("NYC", "has", "subway"),))]
    emb = TableEmbedder({
        "new york city": [1, 0.1, 0], "nyc": [1, 0.2, 0],  # cosine ~0.995
        "usa": [0, 1, 0], "subway": [0.5, 1, 0],  # cosine ~0.89 with each other, below 0.8 with the rest
    })
    kg = KnowledgeGraph.build(per_passage, embedder=emb, config=GraphConfig(synonym_threshold=0.95))
    assert kg.stats["synonymy_edges"] == 1
    a, b = kg.n_passages + kg.phrases.index("new york city"), kg.n_passages + kg.phrases.index("nyc")
    row = kg.csr.indices[kg.csr.indptr[a] : kg.csr.indptr[a + 1]]
    assert b in row
    w = kg.csr.weights[kg.csr.indptr[a] : kg.csr.indptr[a + 1]][list(row).index(b)]
    assert 0.95 <= w <= 1.0
    loose = KnowledgeGraph.build(per_passage, embedder=emb, config=GraphConfig(synonym_threshold=0.8))
    assert loose.stats["synonymy_edges"] == 2  # usa ~ subway joins at 0.8
    assert loose.fact_embeddings.shape == (2, 3)


def test_short_phrases_get_no_synonyms():
    per_passage = [PassageTriples((), (("AB", "x", "ab c"),)), PassageTriples((), (("A B", "y", "abc"),))]
    emb = TableEmbedder({"ab": [1, 0, 0], "a b": [1, 0, 0], "ab c": [0, 1, 0], "abc": [0, 1, 0]})
    kg = KnowledgeGraph.build(per_passage, embedder=emb)
    # "ab" and "a b" have two alphanumerics each: no synonym edge; "ab c" ~ "abc" do get one.
    assert kg.stats["synonymy_edges"] == 1


def test_seed_weights_by_hand():
    kg = KnowledgeGraph.build(small_triples())
    P = kg.n_passages
    # Facts: 0 (albert einstein, ulm), 1 (ulm, germany), 2 (einstein, patent office), 3 (germany, germany)
    fact_scores = np.array([[0.9, 0.5, 0.1, 0.7]])  # min-max -> [1, 0.5, 0, 0.75]
    dense = np.array([[0.2, 0.6, 1.0, 0.2]])  # min-max -> [0, 0.5, 1, 0]
    reset, kept = kg.seed_weights(fact_scores, dense, link_top_k=2, passage_node_weight=0.1)
    assert [f for f, _ in kept[0]] == [0, 3]
    assert kept[0][0][1] == pytest.approx(0.9)
    np.testing.assert_allclose(reset[0, :P], [0.0, 0.05, 0.1, 0.0], atol=1e-7)
    node = {p: P + i for i, p in enumerate(kg.phrases)}
    # phrase means over kept facts: albert einstein 1.0, ulm 1.0, germany 0.75 (twice in fact 3);
    # top-2 phrases by mean: albert einstein and ulm (tie at 1.0, lower node id first); each is
    # divided by the number of passages it occurs in (2 each).
    assert reset[0, node["albert einstein"]] == pytest.approx(0.5)
    assert reset[0, node["ulm"]] == pytest.approx(0.5)
    assert reset[0, node["germany"]] == 0.0
    assert reset[0, node["patent office"]] == 0.0


def test_save_load_roundtrip_and_corruption(tmp_path: Path):
    emb = TableEmbedder({})
    kg = KnowledgeGraph.build(small_triples(), embedder=emb)
    kg.save(tmp_path)
    back = KnowledgeGraph.load(tmp_path)
    assert back.phrases == kg.phrases and back.facts == kg.facts
    np.testing.assert_array_equal(back.csr.indices, kg.csr.indices)
    np.testing.assert_array_equal(back.fact_embeddings, kg.fact_embeddings)
    np.testing.assert_array_equal(back.fact_nodes, kg.fact_nodes)
    np.save(tmp_path / "graph" / "indptr.npy", np.array([0, 1], np.int64))
    with pytest.raises(IndexFormatError, match="inconsistent graph"):
        KnowledgeGraph.load(tmp_path)
    (tmp_path / "graph" / "facts.parquet").write_bytes(b"garbage")
    with pytest.raises(IndexFormatError, match="facts.parquet"):
        KnowledgeGraph.load(tmp_path)


# ----------------------------------------------------------------------------- OpenIE alignment


def _corpus():
    return Corpus([Passage.from_content(t, x) for t, x in [("A", "alpha text"), ("B", "beta text"), ("C", "gamma text")]])


def test_align_by_content_in_any_order():
    corpus = _corpus()
    docs = [
        {"title": "C", "text": "gamma text", "extracted_entities": ["G"], "extracted_triples": [["g", "r", "h"], ["bad"]]},
        {"passage": "A\nalpha text", "extracted_entities": [], "extracted_triples": [["a", "r", "b"]]},
    ]
    al = align_openie({"docs": docs}, corpus)
    assert al.per_passage[0].triples == (("a", "r", "b"),)
    assert al.per_passage[1] == PassageTriples()
    assert al.per_passage[2].entities == ("G",)
    assert al.skipped_triples == 1 and al.missing == [1] and al.aligned_by == "content"


def test_align_by_position_and_errors(tmp_path: Path):
    corpus = _corpus()
    docs = [{"extracted_entities": [], "extracted_triples": [[str(i), "r", "x"]]} for i in range(3)]
    al = align_openie(docs, corpus)
    assert al.aligned_by == "position" and al.per_passage[2].triples == (("2", "r", "x"),)
    with pytest.raises(ValueError, match="position"):
        align_openie(docs[:2], corpus)
    with pytest.raises(ValueError, match="different corpus"):
        align_openie([{"title": "Z", "text": "zeta", "extracted_triples": []}], corpus)
    path = tmp_path / "openie.json"
    path.write_bytes(b"\xff not json")
    with pytest.raises(ValueError, match="not valid UTF-8 JSON"):
        align_openie(path, corpus)
    with pytest.raises(ValueError, match="cannot read"):
        align_openie(tmp_path / "missing.json", corpus)
    round_trip = align_openie(openie_docs(corpus, al.per_passage), corpus)
    assert round_trip.per_passage == al.per_passage and round_trip.aligned_by == "content"


def test_shipped_musique_openie_aligns(musique_dir):
    from raggym.data import load_corpus

    corpus = load_corpus(musique_dir / "corpus.json")
    al = align_openie(musique_dir / "openie_gpt-3.5-turbo-1106.json", corpus)
    assert al.matched == len(corpus) == 1890
    assert al.skipped_triples == 185  # malformed triples in the shipped file
    kg = KnowledgeGraph.build(al.per_passage, config=GraphConfig(include_entities=False))
    assert kg.n_nodes == 18118  # the HippoRAG 2 node count: passages + subject/object phrases


def test_synthetic_world_openie_aligns(small_world):
    al = align_openie(small_world.openie, small_world.corpus)
    assert al.matched == len(small_world.corpus)
    kg = KnowledgeGraph.build(al.per_passage)
    assert kg.stats["facts"] > 0 and kg.stats["passages_without_triples"] < len(small_world.corpus)
    json.dumps(kg.stats)  # stats are JSON-serialisable
