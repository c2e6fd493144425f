"""The Retriever API, hybrid RRF, bad input, persistence and the index/retrieve CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from raggym.retrieval import QueryResult, Retriever, RetrieverConfig, rrf_fuse
from raggym.retrieval.storage import IndexFormatError
from raggym.retrieval.testing import HashingEmbedder


@pytest.fixture(scope="module")
def world_retriever(small_world):
    return Retriever.build(small_world.corpus, embedder=HashingEmbedder(), openie=small_world.openie, cache=False,
                           show_progress=False)


@pytest.fixture(scope="module")
def saved_index(world_retriever, tmp_path_factory):
    return world_retriever.save(tmp_path_factory.mktemp("idx") / "index")


# ----------------------------------------------------------------------------- RRF


def test_rrf_by_hand():
    # a: 1/61; b: 1/62 + 1/61; c: 1/63; d: 1/62
    fused = rrf_fuse([["a", "b", "c"], ["b", "d"]])
    assert [i for i, _ in fused] == ["b", "a", "d", "c"]
    scores = dict(fused)
    assert scores["b"] == pytest.approx(1 / 62 + 1 / 61)
    assert scores["a"] == pytest.approx(1 / 61)
    assert scores["d"] == pytest.approx(1 / 62)
    assert scores["c"] == pytest.approx(1 / 63)


def test_rrf_dedups_ties_and_depth():
    # duplicate inside a list counts once; equal fused scores break by best rank, then first seen
    fused = rrf_fuse([["x", "x", "y"], ["y", "x"]], k_rrf=0)
    assert dict(fused) == {"x": pytest.approx(1 + 1 / 2), "y": pytest.approx(1 / 3 + 1)}
    assert [i for i, _ in rrf_fuse([["p"], ["q"]])] == ["p", "q"]
    assert [i for i, _ in rrf_fuse([["a", "b", "c"], ["c"]], depth=1)] == ["a", "c"]


# ----------------------------------------------------------------------------- the API


@pytest.mark.parametrize("mode", ["passage", "graph", "hybrid"])
def test_modes_return_ranked_hits(world_retriever, small_world, mode):
    questions = [q.question for q in small_world.questions[:12]]
    results = world_retriever.retrieve(questions, mode=mode, k=5)
    assert len(results) == len(questions)
    for res, q in zip(results, questions):
        assert isinstance(res, QueryResult) and res.query == q and res.error is None and res.mode == mode
        assert len(res.hits) == 5 and len(set(res.ids)) == 5
        assert all(h.id in small_world.corpus for h in res.hits)
        assert all(h.text == small_world.corpus.by_id(h.id).text for h in res.hits)
        scores = [h.score for h in res.hits]
        assert scores == sorted(scores, reverse=True)
        assert res.seconds > 0 and res.cost > 0
        d = res.as_dict()
        assert set(d) == {"query", "hits", "seconds", "cost"}
        assert set(d["hits"][0]) == {"id", "title", "score", "text"}
        json.dumps(d)
    if mode != "passage":
        assert all(len(r.facts) == 5 for r in results)  # link_top_k facts, reported to the agent


def test_hybrid_is_rrf_of_passage_and_graph(world_retriever, small_world):
    q = [small_world.questions[0].question]
    dense = world_retriever.retrieve(q, "passage", 5)[0]
    graph = world_retriever.retrieve(q, "graph", 5)[0]
    hybrid = world_retriever.retrieve(q, "hybrid", 5)[0]
    expected = rrf_fuse([dense.ids, graph.ids])[:5]
    assert hybrid.ids == [i for i, _ in expected]
    np.testing.assert_allclose([h.score for h in hybrid.hits], [s for _, s in expected])
    assert hybrid.cost == pytest.approx(dense.cost + graph.cost)


def test_cost_is_deterministic_and_counts_work(world_retriever, small_world):
    qs = [q.question for q in small_world.questions[:6]]
    n = len(small_world.corpus)
    batch = world_retriever.retrieve(qs, "graph", 3)
    alone = world_retriever.retrieve(qs[4:5], "graph", 3)
    assert batch[4].cost == alone[0].cost and batch[4].ids == alone[0].ids
    g = world_retriever.graph
    iterations = (batch[0].cost - n - len(g.facts)) / g.csr.nnz
    assert iterations == int(iterations) and 1 <= iterations <= 16
    assert all(r.cost == n for r in world_retriever.retrieve(qs, "passage", 3))


def test_warm_up_prepares_models(small_world):
    r = Retriever.build(small_world.corpus, embedder=HashingEmbedder(), openie=small_world.openie, cache=False,
                        show_progress=False)
    assert r.warm_up("passage")._ppr is None  # passage mode needs no PPR engine
    assert r.warm_up()._ppr is not None


def test_matches_flat_search_with_shards(small_world):
    emb = HashingEmbedder()
    one = Retriever.build(small_world.corpus, embedder=emb, cache=False, show_progress=False)
    four = Retriever.build(small_world.corpus, embedder=emb, shards=4, cache=False, show_progress=False)
    qs = [q.question for q in small_world.questions[:20]]
    for a, b in zip(one.retrieve(qs, "passage", 10), four.retrieve(qs, "passage", 10)):
        assert a.ids == b.ids and [h.score for h in a.hits] == [h.score for h in b.hits]


# ----------------------------------------------------------------------------- bad input


def test_bad_queries_give_documented_empty_results(world_retriever):
    good = "Who directed The Bitter Emga?"
    queries = ["", "   \n", "x" * 1_000_000, b"\xff\xfe broken", "bad \udc80 surrogate", good, good.encode()]
    results = world_retriever.retrieve(queries, "hybrid", 3)
    errors = [r.error for r in results]
    assert errors[0] == "empty query" and errors[1] == "empty query"
    assert "limit" in errors[2] and len(results[2].query) < 1000  # the 1 MB query is not echoed back
    assert "UTF-8" in errors[3] and "surrogate" in errors[4]
    assert errors[5] is None and errors[6] is None
    assert results[5].ids == results[6].ids  # UTF-8 bytes are decoded and served
    for r in results[:5]:
        assert r.hits == [] and r.cost == 0 and "error" in r.as_dict()
        json.dumps(r.as_dict())
    assert world_retriever.retrieve([""], "graph", 2)[0].error == "empty query"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "sparse"}, "unknown retrieval mode"),
        ({"k": 0}, "positive"),
        ({"k": -3}, "positive"),
        ({"k": 10**6}, "exceeds the corpus"),
        ({"k": 2.5}, "integer"),
        ({"k": True}, "integer"),
    ],
)
def test_bad_arguments_raise_value_error(world_retriever, kwargs, message):
    args = {"mode": "passage", "k": 3, **kwargs}
    with pytest.raises(ValueError, match=message):
        world_retriever.retrieve(["a query"], **args)


def test_bad_query_containers(world_retriever, small_world):
    with pytest.raises(ValueError, match="list"):
        world_retriever.retrieve("a bare string", "passage", 3)
    with pytest.raises(ValueError, match="str or bytes"):
        world_retriever.retrieve([42], "passage", 3)
    assert world_retriever.retrieve([], "graph", 3) == []
    no_graph = Retriever.build(small_world.corpus, embedder=HashingEmbedder(), cache=False, show_progress=False)
    with pytest.raises(ValueError, match="knowledge graph"):
        no_graph.retrieve(["q"], "graph", 3)


# ----------------------------------------------------------------------------- persistence


def test_save_load_gives_identical_results(world_retriever, saved_index, small_world):
    loaded = Retriever.load(saved_index, embedder=HashingEmbedder())
    qs = [q.question for q in small_world.questions[:8]]
    for mode in ("passage", "graph", "hybrid"):
        for a, b in zip(world_retriever.retrieve(qs, mode, 4), loaded.retrieve(qs, mode, 4)):
            assert a.ids == b.ids and a.cost == b.cost
            np.testing.assert_allclose([h.score for h in a.hits], [h.score for h in b.hits], rtol=1e-6)
    assert not list(Path(saved_index).parent.glob(".index.tmp-*"))  # no temporary leftovers
    files = {p.name for p in Path(saved_index).rglob("*")}
    assert not any(name.endswith((".pkl", ".pickle")) for name in files)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "manifest.json").unlink(), "manifest.json is missing"),
        (lambda d: (d / "manifest.json").write_text("{not json"), "corrupted manifest"),
        (lambda d: (d / "graph" / "weights.npy").unlink(), "missing"),
        (lambda d: (d / "passage_embeddings.npy").write_bytes(b"short"), "bytes"),
        (lambda d: _flip_byte(d / "dense" / "shard-000.faiss"), "corrupted"),
        (lambda d: _edit_manifest(d, version=99), "version"),
        (lambda d: _edit_manifest(d, passages=3), "does not match"),
    ],
)
def test_damaged_index_is_a_clear_value_error(saved_index, tmp_path, damage, message):
    target = _copy(saved_index, tmp_path / "copy")
    damage(target)
    with pytest.raises(IndexFormatError, match=message) as info:
        Retriever.load(target, embedder=HashingEmbedder())
    assert isinstance(info.value, ValueError)


def _flip_byte(path: Path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_manifest(root: Path, **changes):
    manifest = json.loads((root / "manifest.json").read_text())
    manifest.update(changes)
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_missing_dir_and_mismatched_embedder(saved_index, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Retriever.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a raggym index"):
        Retriever.load(tmp_path / "empty")
    with pytest.raises(ValueError, match="dim"):
        Retriever.load(saved_index, embedder=HashingEmbedder(dim=32))
    with pytest.raises(ValueError, match="embedder"):
        Retriever.load(saved_index, embedder=HashingEmbedder(name="another-model"))


def test_failed_save_keeps_the_old_index(world_retriever, saved_index, tmp_path, monkeypatch):
    target = _copy(saved_index, tmp_path / "index")
    before = sorted(p.name for p in target.rglob("*"))

    def boom(*_a, **_k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(type(world_retriever.graph), "save", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        world_retriever.save(target)
    assert sorted(p.name for p in target.rglob("*")) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".index.")]
    Retriever.load(target, embedder=HashingEmbedder())  # still a valid index


def test_ensure_index_builds_once_and_refuses_another_corpus(small_world, tmp_path, capsys):
    from raggym.data import Corpus
    from raggym.retrieval import ensure_index

    target = tmp_path / "runs" / "index"
    options = dict(embedder=HashingEmbedder(), cache=False, show_progress=False)
    assert ensure_index(target, small_world.corpus, openie=small_world.openie, **options) == target
    assert "building the dense + knowledge graph index" in capsys.readouterr().err
    manifest = target / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    loaded = Retriever.load(target, embedder=HashingEmbedder())
    assert loaded.graph is not None and len(loaded.corpus) == len(small_world.corpus)
    assert ensure_index(target, small_world.corpus, openie=small_world.openie, **options) == target
    assert capsys.readouterr().err == "" and manifest.stat().st_mtime_ns == stamp  # not rebuilt
    other = Corpus(list(small_world.corpus)[:-1])
    with pytest.raises(IndexFormatError, match="built from a different corpus"):
        ensure_index(target, other, **options)
    assert [p.name for p in target.parent.iterdir()] == ["index"]  # no temporary left by the build


# ----------------------------------------------------------------------------- the CLI


CLI_PASSAGES = 12


@pytest.fixture(scope="module")
def tiny_corpus_files(small_world, tmp_path_factory):
    """A dozen synthetic passages with their OpenIE triples as files, and a query file: one passage's
    text (its title must come first), an empty line, a line that is not UTF-8, a question."""
    from raggym.data.loaders import write_corpus

    root = tmp_path_factory.mktemp("cli")
    passages = list(small_world.corpus)[:CLI_PASSAGES]
    write_corpus(root / "corpus.json", passages)
    (root / "openie.json").write_text(json.dumps({"docs": small_world.openie["docs"][:CLI_PASSAGES]}))
    (root / "queries.txt").write_bytes(
        f"{passages[4].text}\n\n".encode() + b"\xff\xfe\n" + f"Who is {passages[0].title}?\n".encode())
    (root / "expected_title").write_text(passages[4].title)
    return root


def _cli(argv, capsys):
    from raggym.retrieval.cli import main

    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_index_and_retrieve(tiny_corpus_files, capsys):
    root = tiny_corpus_files
    rc, out, err = _cli(["index", "--corpus", str(root / "corpus.json"), "--openie", str(root / "openie.json"),
                         "--shards", "2", "--out", str(root / "idx"), "--json", "--quiet"], capsys)
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["passages"] == 12 and summary["dense"]["shards"] == 2 and summary["graph"]["nodes"] > 12
    for mode in ("passage", "hybrid"):  # hybrid runs the graph path too
        rc, out, err = _cli(["retrieve", "--index", str(root / "idx"), "--mode", mode, "-k", "3",
                             "--queries-file", str(root / "queries.txt"), "--json"], capsys)
        assert rc == 0, err
        lines = [json.loads(line) for line in out.splitlines()]
        assert len(lines) == 4  # one per input line, in order
        assert lines[0]["hits"][0]["title"] == (root / "expected_title").read_text()
        assert {"query", "hits", "seconds", "cost"} <= set(lines[0])
        assert lines[1]["error"] == "empty query" and "UTF-8" in lines[2]["error"]
        assert len(lines[3]["hits"]) == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["retrieve", "--index", "{idx}", "--mode", "magic", "-k", "3", "--query", "q"], "unknown mode"),
        (["retrieve", "--index", "{idx}", "--mode", "graph", "-k", "0", "--query", "q"], "positive"),
        (["retrieve", "--index", "{idx}", "--mode", "graph", "-k", "999", "--query", "q"], "exceeds"),
        (["retrieve", "--index", "{root}/nope", "-k", "3", "--query", "q"], "does not exist"),
        (["retrieve", "--index", "{idx}", "-k", "3", "--queries-file", "{root}/none.txt"], "cannot read"),
        (["retrieve", "--index", "{idx}", "-k", "3"], "exactly one of"),
        (["index", "--corpus", "{root}/queries.txt", "--out", "{root}/x"], "not UTF-8"),
        (["index", "--corpus", "{root}/corpus.json", "--out", "{root}/x", "--shards", "0"], "shards"),
        (["index", "--corpus", "{root}/corpus.json", "--openie", "{root}/none.json", "--out", "{root}/x"], "does not exist"),
        (["index", "--corpus", "{root}/corpus.json", "--embedder", "no-such-model", "--out", "{root}/x"], "model spec"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tiny_corpus_files, capsys, argv, message):
    root = tiny_corpus_files
    if not (root / "idx").exists():
        assert _cli(["index", "--corpus", str(root / "corpus.json"), "--openie", str(root / "openie.json"),
                     "--out", str(root / "idx"), "--quiet"], capsys)[0] == 0
    argv = [a.format(root=root, idx=root / "idx") for a in argv]
    rc, out, err = _cli(argv, capsys)
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("raggym ") and message in lines[0], err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- real data


@pytest.fixture(scope="module")
def musique_subset(musique_dir):
    """The passages of the first 5 MuSiQue questions (100) with their shipped OpenIE triples, MiniLM."""
    from raggym.data import Corpus, load_corpus, load_questions

    full = load_corpus(musique_dir / "corpus.json")
    questions = load_questions(musique_dir / "questions.json", full)[:5]
    raw = json.loads((musique_dir / "questions.json").read_text())[:5]
    wanted = {(p["title"], p["paragraph_text"].strip()) for q in raw for p in q["paragraphs"]}
    corpus = Corpus([p for p in full if (p.title, p.text.strip()) in wanted], name="musique-5")
    openie = json.loads((musique_dir / "openie_gpt-3.5-turbo-1106.json").read_text())
    docs = [d for d in openie["docs"] if (d["title"], d["text"].strip()) in wanted]
    retriever = Retriever.build(corpus, embedder="minilm", openie={"docs": docs}, show_progress=False)
    return retriever, questions


def _recall(results, questions, k):
    return float(np.mean([len(set(r.ids[:k]) & set(q.gold_passage_ids)) / len(q.gold_passage_ids)
                          for r, q in zip(results, questions)]))


def test_real_musique_subset_end_to_end(musique_subset):
    retriever, questions = musique_subset
    assert len(retriever.corpus) == 100
    recalls = {}
    for mode in ("passage", "graph", "hybrid"):
        results = retriever.retrieve([q.question for q in questions], mode, 5)
        recalls[mode] = _recall(results, questions, 5)
    # 20 candidate paragraphs per question; all three modes must find most gold passages
    assert min(recalls.values()) >= 0.5, recalls


# The 60-question graph-vs-dense claim on the full musique_sub corpus: tests/test_musique_recall.py.


def test_config_validation():
    with pytest.raises(ValueError):
        RetrieverConfig(damping=1.5).validate()
    with pytest.raises(ValueError):
        RetrieverConfig(rrf_depth=0).validate()
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


# ----------------------------------------------------------------------------- encoding and cache


def test_embedding_cache_keys_and_recovery(tmp_path):
    from raggym.retrieval.encoding import EmbeddingCache

    class Counting(HashingEmbedder):
        calls = 0

        def encode(self, texts, **kw):
            Counting.calls += 1
            return super().encode(texts, **kw)

    emb = Counting()
    cache = EmbeddingCache(tmp_path)
    a = cache.encode(emb, ["alpha beta", "gamma"], kind="passage")
    b = cache.encode(emb, ["alpha beta", "gamma"], kind="passage")
    assert Counting.calls == 1 and cache.hits == 1 and (a == b).all()
    cache.encode(emb, ["alpha beta", "gamma!"], kind="passage")  # any text change misses
    cache.encode(emb, ["alpha beta", "gamma"], kind="fact")  # so does another kind
    cache.encode(HashingEmbedder(name="other"), ["alpha beta", "gamma"])  # and another model
    assert Counting.calls == 3
    for f in tmp_path.glob("*.npy"):
        f.write_bytes(b"junk")  # a corrupted cache file is recomputed, not trusted
    c = cache.encode(emb, ["alpha beta", "gamma"], kind="passage")
    assert Counting.calls == 4 and np.allclose(a, c)
    assert not list(tmp_path.glob("*.tmp"))


def test_bucketed_encoding_matches_the_embedder():
    from raggym.models import load_embedder
    from raggym.retrieval.encoding import encode_texts

    emb = load_embedder("minilm")
    texts = ["short", "a much longer text about lakes and rivers " * 12, "mid length text here", "x"]
    expected = emb.encode(texts, sort_by_length=False)
    for budget in (16, 64, 4096):  # buckets of one text up to one bucket for all
        np.testing.assert_allclose(encode_texts(emb, texts, token_budget=budget), expected, atol=1e-5)
    np.testing.assert_allclose(encode_texts(emb, texts, bucketed=False), expected, atol=1e-6)
    assert encode_texts(emb, []).shape == (0, emb.dim)
    with pytest.raises(ValueError, match="precision"):
        encode_texts(emb, texts, precision="int4")
