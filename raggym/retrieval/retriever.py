"""One retrieval API for the three modes the agent chooses between.

    r = Retriever.build(corpus, embedder="minilm", openie="openie.json")
    r.save("index/")
    r = Retriever.load("index/")
    results = r.retrieve(["Who directed Alien?"], mode="hybrid", k=5)   # list[QueryResult]

Modes:

- ``passage``: dense retrieval, exact inner product over the (sharded) FAISS index.
- ``graph``: HippoRAG 2-style retrieval (link the query to facts by embedding similarity, seed
  the facts' phrase nodes and every passage node, run personalized PageRank, rank passages by
  their PPR score; see ``KnowledgeGraph.seed_weights``). An index without any facts answers
  graph queries with the dense ranking.
- ``hybrid``: reciprocal-rank fusion of the passage and graph top-``depth`` lists (depth = k
  unless ``rrf_depth`` is set), deduplicated by passage id.

Hit scores are the mode's own: inner product, PPR probability, or fused RRF score.

Per-query accounting. ``seconds`` is the wall time of the query's own work (encoding, search,
graph ranking), measured with the query served alone (``RetrieverConfig.timing="per_query"``,
the default), so it does not depend on which other queries shared the call. RouteRAG's
efficiency reward compares these times across modes, as the official RouteRAG code does by
timing each query on its own. ``timing="batch"`` serves the call as one batch (faster) and
splits its wall time evenly over the queries; a query's ``seconds`` then depends on its batch.
``cost`` counts work units that depend only on the query and the index: one unit per vector
whose inner product with the query was computed and one per nonzero of the graph matrix per
PPR iteration. Passage: vectors scanned (all passages for the exact index). Graph: passages +
facts scanned + PPR iterations x nnz. Hybrid: the sum of both.

Bad input never crashes the process:

- raises ``ValueError``: unknown mode; ``k`` not an integer, ``k <= 0`` or ``k`` larger than the
  corpus; ``queries`` not a list/tuple of ``str``/``bytes``; graph mode on an index built
  without OpenIE; a missing, corrupted or mismatched index directory (``Retriever.load``).
- returns an empty ``QueryResult`` with ``error`` set (and cost 0), so one bad query does not
  sink a batch: an empty or whitespace-only query; a query longer than ``max_query_chars``
  (default 65,536 characters, e.g. a 1 MB paste); bytes that are not valid UTF-8; a string with
  unpaired surrogates.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from raggym.atomic import atomic_directory
from raggym.data import Corpus, Passage, load_corpus
from raggym.models import load_embedder

from .base import Hit, QueryResult, check_mode
from .dense import DenseConfig, DenseIndex
from .encoding import EmbeddingCache, embedder_identity, encode_texts, passage_text
from .graph import GraphConfig, KnowledgeGraph
from .hybrid import rrf_fuse
from .openie_io import align_openie
from .ppr import TorchPPR, top_k_rows
from .storage import (
    MANIFEST,
    IndexFormatError,
    load_npy,
    read_manifest,
    read_table,
    verify_files,
    write_manifest,
    write_table,
)


TIMINGS = ("per_query", "batch")


@dataclass(frozen=True)
class RetrieverConfig:
    link_top_k: int = 5  # facts kept per query, and phrase nodes seeded
    passage_node_weight: float = 0.05  # dense-score seed of every passage node
    damping: float = 0.5
    ppr_tol: float = 1e-5  # every PPR score within 1e-5 of the exact solution (L1 bound)
    ppr_max_iter: int = 100
    ppr_batch_size: int = 64
    ppr_threads: int | None = 1  # see the threads note in raggym.retrieval.ppr
    ppr_device: str = "cpu"
    rrf_k: int = 60
    rrf_depth: int | None = None  # None: fuse the top-k of each list
    max_query_chars: int = 65_536
    query_batch_size: int = 64
    precision: str = "fp32"  # query and passage encoding ("bf16" autocast is faster on AMX CPUs)
    # "per_query": serve and time each query alone, so its seconds are its own (RouteRAG's t);
    # "batch": one batched pass, its wall time split evenly over the queries (faster).
    timing: str = "per_query"

    def validate(self) -> "RetrieverConfig":
        if self.timing not in TIMINGS:
            raise ValueError(f"timing must be one of {', '.join(TIMINGS)}, got {self.timing!r}")
        if self.link_top_k < 0 or self.ppr_batch_size < 1 or self.query_batch_size < 1:
            raise ValueError("link_top_k must be >= 0 and batch sizes >= 1")
        if not 0 < self.damping < 1:
            raise ValueError(f"damping must lie in (0, 1), got {self.damping}")
        if self.rrf_depth is not None and self.rrf_depth < 1:
            raise ValueError("rrf_depth must be positive")
        return self


def corpus_fingerprint(passages) -> str:
    """SHA-1 over ids, titles and texts in order (detects any change, explicit ids included)."""
    h = hashlib.sha1()
    for p in passages:
        for part in (p.id, p.title, p.text):
            h.update(part.encode("utf-8", "surrogatepass"))
            h.update(b"\x00")
    return h.hexdigest()


def _as_corpus(corpus):
    if isinstance(corpus, Corpus):
        return corpus
    if isinstance(corpus, (str, os.PathLike)):
        return load_corpus(corpus)
    return Corpus(list(corpus))


class Retriever:
    # The clock that ``seconds`` is read from; an attribute so that a benchmark or a test can read
    # a clock of its own (e.g. one that advances with the work done) without touching the code.
    clock = staticmethod(time.perf_counter)

    def __init__(self, corpus, passage_vectors: np.ndarray, dense: DenseIndex, graph: KnowledgeGraph | None,
                 *, embedder=None, embedder_spec: str | None = None, embedder_id: str | None = None,
                 config: RetrieverConfig | None = None):
        self.corpus = corpus
        self.passage_vectors = passage_vectors
        self.dense = dense
        self.graph = graph
        self.config = (config or RetrieverConfig()).validate()
        self._embedder = embedder
        self.embedder_spec = embedder_spec or getattr(embedder, "spec", None)
        self.embedder_id = embedder_id or (embedder_identity(embedder) if embedder is not None else None)
        self._ppr: TorchPPR | None = None

    # ------------------------------------------------------------------ building

    @classmethod
    def build(
        cls,
        corpus,
        *,
        embedder="minilm",
        openie=None,
        shards: int = 1,
        index: str | DenseConfig = "flat",
        graph_config: GraphConfig | None = None,
        config: RetrieverConfig | None = None,
        cache: EmbeddingCache | bool | None = True,
        show_progress: bool = True,
    ) -> "Retriever":
        """Encode the corpus, build the dense index and (when ``openie`` is given) the graph.

        ``corpus``: a ``Corpus``, a list of ``Passage`` or a corpus file path. ``embedder``: a spec
        for ``raggym.models.load_embedder`` or an object with ``encode``/``dim``/``name``.
        ``openie``: a HippoRAG-format OpenIE file path, its parsed dict or docs list, or a list of
        ``PassageTriples`` aligned with the corpus. ``cache``: ``True`` for the default
        ``.npy`` cache, ``False``/``None`` for none, or an ``EmbeddingCache``.
        """
        config = (config or RetrieverConfig()).validate()
        corpus = _as_corpus(corpus)
        if len(corpus) == 0:
            raise ValueError("cannot index an empty corpus")
        spec = None
        if isinstance(embedder, str):
            spec = embedder
            embedder = load_embedder(embedder)
        if cache is True:
            cache = EmbeddingCache()
        elif not cache:
            cache = EmbeddingCache(enabled=False)
        dense_config = index if isinstance(index, DenseConfig) else DenseConfig(kind=index, shards=shards)
        dense_config.validate()
        alignment = align_openie(openie, corpus) if openie is not None else None
        vectors = cache.encode(embedder, [passage_text(p.title, p.text) for p in corpus], kind="passage",
                               precision=config.precision, show_progress=show_progress)
        dense = DenseIndex.build(vectors, dense_config)
        graph = None
        if alignment is not None:
            graph = KnowledgeGraph.build(alignment.per_passage, embedder=embedder, cache=cache, config=graph_config,
                                         precision=config.precision, show_progress=show_progress)
            graph.stats["openie_source"] = alignment.source
            graph.stats["openie_skipped_triples"] = alignment.skipped_triples
            graph.stats["openie_passages_without_doc"] = len(alignment.missing)
        return cls(corpus, vectors, dense, graph, embedder=embedder, embedder_spec=spec, config=config)

    # ------------------------------------------------------------------ persistence

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the index to ``directory`` atomically (temporary sibling, then rename)."""
        final = Path(directory)
        with atomic_directory(final) as tmp:
            write_table(tmp / "passages.parquet", {
                "id": [p.id for p in self.corpus],
                "title": [p.title for p in self.corpus],
                "text": [p.text for p in self.corpus],
            })
            np.save(tmp / "passage_embeddings.npy", self.passage_vectors, allow_pickle=False)
            self.dense.save(tmp)
            if self.graph is not None:
                self.graph.save(tmp)
            write_manifest(tmp, {
                "passages": len(self.corpus),
                "dim": int(self.passage_vectors.shape[1]),
                "corpus_sha1": corpus_fingerprint(self.corpus),
                "embedder": {"spec": self.embedder_spec, "identity": self.embedder_id},
                "has_graph": self.graph is not None,
                "config": asdict(self.config),
            })
        return final

    @classmethod
    def load(cls, directory: str | os.PathLike, *, embedder=None, verify: bool = True,
             config: RetrieverConfig | None = None) -> "Retriever":
        """Open an index written by ``save``. Any inconsistency raises ``IndexFormatError`` (a ValueError).

        ``embedder``: the embedder object to use for queries; by default the spec recorded at
        build time is loaded on first use. ``verify`` checks file checksums as well as sizes.
        """
        root = Path(directory)
        manifest = read_manifest(root)
        verify_files(root, manifest, checksums=verify)
        table = read_table(root, "passages.parquet", ("id", "title", "text"))
        try:
            corpus = Corpus([Passage(i, t, x) for i, t, x in zip(table["id"], table["title"], table["text"])], name=root.name)
        except (ValueError, TypeError) as e:
            raise IndexFormatError(f"{root}: invalid passage table ({e})") from None
        if len(corpus) != manifest.get("passages") or corpus_fingerprint(corpus) != manifest.get("corpus_sha1"):
            raise IndexFormatError(f"{root}: passage table does not match the manifest (mismatched or edited index)")
        vectors = load_npy(root, "passage_embeddings.npy", dtype=np.float32, ndim=2)
        if vectors.shape != (len(corpus), manifest.get("dim")):
            raise IndexFormatError(f"{root}: passage embeddings have shape {vectors.shape}, expected ({len(corpus)}, {manifest.get('dim')})")
        dense = DenseIndex.load(root)
        if dense.ntotal != len(corpus) or dense.dim != vectors.shape[1]:
            raise IndexFormatError(f"{root}: dense index holds {dense.ntotal} vectors of dim {dense.dim}, expected {len(corpus)} of dim {vectors.shape[1]}")
        graph = None
        if manifest.get("has_graph"):
            graph = KnowledgeGraph.load(root)
            if graph.n_passages != len(corpus):
                raise IndexFormatError(f"{root}: graph has {graph.n_passages} passage nodes for {len(corpus)} passages")
            if graph.fact_embeddings is not None and graph.fact_embeddings.shape[1] != vectors.shape[1]:
                raise IndexFormatError(f"{root}: fact embeddings have dim {graph.fact_embeddings.shape[1]}, passages {vectors.shape[1]}")
        emb_meta = manifest.get("embedder") or {}
        if embedder is not None:
            if int(embedder.dim) != vectors.shape[1]:
                raise IndexFormatError(f"{root}: the index was built with {vectors.shape[1]}-dim embeddings; the given embedder makes {embedder.dim}-dim ones")
            if emb_meta.get("identity") and embedder_identity(embedder) != emb_meta["identity"]:
                raise IndexFormatError(
                    f"{root}: the index was built with embedder {emb_meta['identity']!r}, not {embedder_identity(embedder)!r}"
                )
        elif not emb_meta.get("spec"):
            raise IndexFormatError(f"{root}: the manifest records no embedder spec; pass embedder= to Retriever.load")
        try:
            saved = RetrieverConfig(**manifest.get("config", {}))
        except TypeError as e:
            raise IndexFormatError(f"{root}: unreadable retriever config ({e})") from None
        return cls(corpus, vectors, dense, graph, embedder=embedder, embedder_spec=emb_meta.get("spec"),
                   embedder_id=emb_meta.get("identity"), config=config or saved)

    # ------------------------------------------------------------------ querying

    @property
    def embedder(self):
        if self._embedder is None:
            self._embedder = load_embedder(self.embedder_spec)
            if int(self._embedder.dim) != self.passage_vectors.shape[1]:
                raise ValueError(f"embedder {self.embedder_spec!r} makes {self._embedder.dim}-dim vectors; the index has {self.passage_vectors.shape[1]}")
        return self._embedder

    @property
    def ppr(self) -> TorchPPR:
        if self._ppr is None:
            c = self.config
            self._ppr = TorchPPR(self.graph.csr, c.damping, tol=c.ppr_tol, max_iter=c.ppr_max_iter,
                                 threads=c.ppr_threads, device=c.ppr_device)
        return self._ppr

    def warm_up(self, mode: str | None = None) -> "Retriever":
        """Load the query embedder (and the PPR engine unless ``mode='passage'``) now, so the
        first timed query does not pay for it."""
        self.embedder
        if self.graph is not None and mode != "passage":
            self.ppr
        return self

    def _clean_query(self, q) -> tuple[str, str | None]:
        """Return ``(text, error)``; ``error`` is None for a servable query."""
        if isinstance(q, (bytes, bytearray, memoryview)):
            raw = bytes(q)
            try:
                q = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return raw.decode("utf-8", "replace"), f"query is not valid UTF-8 (bad byte at offset {e.start})"
        elif not isinstance(q, str):
            raise ValueError(f"each query must be str or bytes, got {type(q).__name__}")
        try:
            q.encode("utf-8")
        except UnicodeEncodeError as e:
            return q.encode("utf-8", "replace").decode("utf-8"), f"query contains an unpaired surrogate at index {e.start}"
        if not q.strip():
            return q, "empty query"
        if len(q) > self.config.max_query_chars:
            return q[:200] + "…", f"query is {len(q)} characters; the limit is {self.config.max_query_chars}"
        return q, None

    def _check_k(self, k) -> int:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise ValueError(f"k must be an integer, got {k!r}")
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        if k > len(self.corpus):
            raise ValueError(f"k={k} exceeds the corpus size ({len(self.corpus)} passages)")
        return int(k)

    def encode_queries(self, texts: Sequence[str]) -> np.ndarray:
        return encode_texts(self.embedder, list(texts), batch_size=self.config.query_batch_size,
                            precision=self.config.precision)

    def retrieve(self, queries: Sequence[str | bytes], mode: str = "passage", k: int = 5) -> list[QueryResult]:
        """Retrieve the top ``k`` passages for each query; one ``QueryResult`` per query, in order."""
        check_mode(mode)
        k = self._check_k(k)
        if isinstance(queries, (str, bytes)) or not isinstance(queries, (list, tuple)):
            raise ValueError("queries must be a list of strings (wrap a single query in a list)")
        if mode in ("graph", "hybrid") and self.graph is None:
            raise ValueError(f"{mode!r} retrieval needs a knowledge graph; build the index with OpenIE triples (openie=...)")
        cleaned = [self._clean_query(q) for q in queries]
        results = [QueryResult(query=text, mode=mode, error=err) for text, err in cleaned]
        live = [i for i, (_, err) in enumerate(cleaned) if err is None]
        if not live:
            return results
        # Load the embedder and the PPR engine (first call only) outside the timed part. A subclass
        # that ranks the graph elsewhere (the Ray retrieval service) never builds a local engine.
        self.embedder
        if mode != "passage" and self.graph is not None and type(self)._graph_rank is Retriever._graph_rank:
            self.ppr
        if self.config.timing == "per_query":
            for i in live:
                started = self.clock()
                self._serve([results[i]], [cleaned[i][0]], mode, k)
                results[i].seconds = self.clock() - started
            return results
        started = self.clock()
        self._serve([results[i] for i in live], [cleaned[i][0] for i in live], mode, k)
        per_query = (self.clock() - started) / len(live)
        for i in live:
            results[i].seconds = per_query
        return results

    def _serve(self, results: list[QueryResult], texts: list[str], mode: str, k: int) -> None:
        """Fill ``results`` (hits, cost, facts) for the valid query ``texts``, in one batch."""
        q_vecs = self.encode_queries(texts)
        depth = max(k, self.config.rrf_depth or k)
        if mode in ("passage", "hybrid"):
            d_scores, d_rows = self.dense.search(q_vecs, depth if mode == "hybrid" else k)
            d_cost = self.dense.cost(q_vecs)
        if mode in ("graph", "hybrid"):
            g_rows, g_scores, g_cost, g_facts = self._graph_rank(q_vecs, depth if mode == "hybrid" else k)
        for j, res in enumerate(results):
            if mode == "passage":
                res.hits = self._hits(d_rows[j], d_scores[j])
                res.cost = float(d_cost[j])
            elif mode == "graph":
                res.hits = self._hits(g_rows[j], g_scores[j])
                res.cost = float(g_cost[j])
                res.facts = g_facts[j]
            else:
                fused = rrf_fuse([[int(r) for r in d_rows[j] if r >= 0], [int(r) for r in g_rows[j]]],
                                 k_rrf=self.config.rrf_k)[:k]
                res.hits = self._hits([r for r, _ in fused], [s for _, s in fused])
                res.cost = float(d_cost[j] + g_cost[j])
                res.facts = g_facts[j]

    def _hits(self, rows, scores) -> list[Hit]:
        out = []
        for r, s in zip(rows, scores):
            r = int(r)
            if r < 0:
                continue
            p = self.corpus[r]
            out.append(Hit(id=p.id, title=p.title, text=p.text, score=float(s)))
        return out

    def _graph_rank(self, q_vecs: np.ndarray, k: int):
        """HippoRAG 2 graph search for a batch of query vectors."""
        g = self.graph
        c = self.config
        n_pass = len(self.corpus)
        dense_all = q_vecs @ self.passage_vectors.T  # [B, P]: seeds every passage node
        n_facts = 0 if g.fact_embeddings is None else len(g.facts)
        if n_facts == 0:  # nothing to link to: the dense ranking is the graph answer
            rows = top_k_rows(dense_all, k)
            scores = np.take_along_axis(dense_all, rows, axis=1)
            return rows, scores, np.full(len(q_vecs), float(n_pass)), [[] for _ in range(len(q_vecs))]
        fact_scores = q_vecs @ g.fact_embeddings.T  # [B, F]
        all_rows, all_scores, costs, facts = [], [], [], []
        passage_nodes = np.arange(n_pass)
        for start in range(0, len(q_vecs), c.ppr_batch_size):
            sl = slice(start, start + c.ppr_batch_size)
            reset, kept = g.seed_weights(fact_scores[sl], dense_all[sl], link_top_k=c.link_top_k,
                                         passage_node_weight=c.passage_node_weight)
            result = self.ppr.run(reset, nodes=passage_nodes)
            rows = top_k_rows(result.scores, k)
            all_rows.append(rows)
            all_scores.append(np.take_along_axis(result.scores, rows, axis=1))
            costs.append(n_pass + n_facts + result.iterations.astype(np.float64) * g.csr.nnz)
            facts.extend([[(*g.facts[f], score) for f, score in kept_b] for kept_b in kept])
        return np.concatenate(all_rows), np.concatenate(all_scores), np.concatenate(costs), facts

    # ------------------------------------------------------------------ info

    def describe(self) -> dict:
        return {
            "passages": len(self.corpus),
            "dim": int(self.passage_vectors.shape[1]),
            "embedder": self.embedder_spec,
            "dense": {"kind": self.dense.config.kind, "shards": self.dense.config.shards},
            "graph": None if self.graph is None else dict(self.graph.stats),
        }


def ensure_index(index_dir: str | os.PathLike, corpus, *, openie=None, shards: int = 1,
                 show_progress: bool = True, **build_options) -> Path:
    """The index directory for ``corpus``, built and saved (atomically) only if it has no manifest yet.

    ``corpus`` is a ``Corpus``, a list of passages or a corpus file; ``openie``, ``shards`` and
    ``build_options`` (``embedder``, ``config``, ``cache``, ...) go to ``Retriever.build``. Building prints one line to stderr first (it can take minutes). An
    existing index is not rebuilt, but it must have been built from this very corpus: a manifest
    with another corpus fingerprint raises ``IndexFormatError`` (a stale ``index_dir`` would
    otherwise serve passages whose ids do not match the questions' gold). Returns ``index_dir``.
    """
    root = Path(index_dir)
    corpus = _as_corpus(corpus)
    if (root / MANIFEST).exists():
        built_from = read_manifest(root).get("corpus_sha1")
        if built_from != corpus_fingerprint(corpus):
            raise IndexFormatError(f"index {root} was built from a different corpus than the {len(corpus)} passages "
                                   f"given; delete it or point index_dir elsewhere to rebuild")
        return root
    kind = "dense + knowledge graph" if openie is not None else "dense"
    print(f"[raggym] building the {kind} index of {len(corpus)} passages under {root}", file=sys.stderr, flush=True)
    Retriever.build(corpus, openie=openie, shards=int(shards), show_progress=show_progress, **build_options).save(root)
    return root
