"""HippoRAG 2-style knowledge graph: passage and phrase nodes, three kinds of edges, CSR storage.

Nodes. Rows ``0 .. P-1`` are the corpus passages in corpus order; rows ``P ..`` are phrase
nodes, one per distinct normalized phrase (subjects and objects of triples, plus the NER
entities of each passage when ``include_entities``).

Edges (undirected, parallel edges summed):

- relation edges between a triple's subject and object, weight = how often the pair occurs;
- context edges between a passage and every phrase extracted from it, weight 1;
- synonymy edges between phrases whose embeddings have cosine >= ``synonym_threshold`` (0.8),
  weight = the cosine. Candidates come from a FAISS inner-product search over the phrase
  embeddings (at most ``synonym_max_neighbors`` per phrase); phrases with two or fewer
  alphanumeric characters get none, since their embeddings are unreliable.

Facts are the distinct normalized triples; their "subject relation object" texts are embedded
for query-to-fact linking. ``seed_weights`` turns fact and dense scores into the PPR reset
vectors; see its docstring for the exact rule.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .encoding import EmbeddingCache
from .openie_io import PassageTriples
from .ppr import CSRGraph
from .storage import IndexFormatError, load_npy, read_table, write_table

_NON_WORD = re.compile(r"[^\w\s]|_", re.UNICODE)


def normalize_phrase(text: str) -> str:
    """Lower-case, punctuation to spaces, whitespace collapsed: "Ulm, Germany." -> "ulm germany"."""
    return " ".join(_NON_WORD.sub(" ", text.lower()).split())


def _alnum_count(text: str) -> int:
    return sum(ch.isalnum() for ch in text)


@dataclass(frozen=True)
class GraphConfig:
    synonym_threshold: float = 0.8
    synonym_max_neighbors: int = 100
    synonyms: bool = True
    include_entities: bool = True
    relation_weight: float = 1.0
    context_weight: float = 1.0

    def validate(self) -> "GraphConfig":
        if not -1.0 <= self.synonym_threshold <= 1.0:
            raise ValueError(f"synonym_threshold must lie in [-1, 1], got {self.synonym_threshold}")
        if self.relation_weight <= 0 or self.context_weight <= 0:
            raise ValueError("edge weights must be positive")
        return self


def min_max(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Scale to [0, 1] along ``axis``; a constant row maps to all ones (every item equally good)."""
    lo = x.min(axis=axis, keepdims=True)
    hi = x.max(axis=axis, keepdims=True)
    span = hi - lo
    safe = np.where(span > 0, span, 1.0)
    return np.where(span > 0, (x - lo) / safe, 1.0)


class KnowledgeGraph:
    def __init__(
        self,
        n_passages: int,
        phrases: list[str],
        phrase_passage_count: np.ndarray,
        facts: list[tuple[str, str, str]],
        fact_nodes: np.ndarray,
        csr: CSRGraph,
        fact_embeddings: np.ndarray | None,
        config: GraphConfig,
        stats: dict,
    ):
        self.n_passages = int(n_passages)
        self.phrases = phrases
        self.phrase_passage_count = np.asarray(phrase_passage_count, dtype=np.int64)
        self.facts = facts
        self.fact_nodes = np.asarray(fact_nodes, dtype=np.int64).reshape(-1, 2)  # global node ids (subject, object)
        self.csr = csr
        self.fact_embeddings = fact_embeddings
        self.config = config
        self.stats = stats

    @property
    def n_nodes(self) -> int:
        return self.n_passages + len(self.phrases)

    @staticmethod
    def fact_text(fact: tuple[str, str, str]) -> str:
        return " ".join(x for x in fact if x)

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(
        cls,
        per_passage: list[PassageTriples],
        *,
        embedder=None,
        cache=None,
        config: GraphConfig | None = None,
        precision: str = "fp32",
        show_progress: bool = False,
    ) -> "KnowledgeGraph":
        """Build from per-passage triples (aligned with the corpus).

        ``embedder=None`` builds the structure only: no synonymy edges and no fact embeddings
        (enough for PPR benchmarks; graph retrieval needs the embeddings).
        """
        # tqdm is imported on use: it would add about a tenth to the time of `import raggym, envs`.
        from tqdm.auto import tqdm

        config = (config or GraphConfig()).validate()
        n_pass = len(per_passage)
        phrase_ids: dict[str, int] = {}
        phrases: list[str] = []
        fact_ids: dict[tuple[str, str, str], int] = {}
        fact_nodes: list[tuple[int, int]] = []
        rel_src: list[int] = []
        rel_dst: list[int] = []
        ctx_pass: list[int] = []
        ctx_phrase: list[int] = []
        dropped = 0
        norm_cache: dict[str, str] = {}

        def norm(x: str) -> str:
            out = norm_cache.get(x)
            if out is None:
                out = norm_cache[x] = normalize_phrase(x)
            return out

        def phrase_of(text: str) -> int:
            j = phrase_ids.get(text)
            if j is None:
                j = phrase_ids[text] = len(phrases)
                phrases.append(text)
            return j

        for i, pt in enumerate(tqdm(per_passage, desc="graph: triples", unit="passage", disable=not show_progress)):
            here: dict[int, None] = {}
            for s, r, o in pt.triples:
                s, r, o = norm(s), norm(r), norm(o)
                if not s or not o:
                    dropped += 1
                    continue
                js, jo = phrase_of(s), phrase_of(o)
                key = (s, r, o)
                if key not in fact_ids:
                    fact_ids[key] = len(fact_nodes)
                    fact_nodes.append((n_pass + js, n_pass + jo))
                if js != jo:
                    rel_src.append(js)
                    rel_dst.append(jo)
                here[js] = None
                here[jo] = None
            if config.include_entities:
                for e in pt.entities:
                    e = norm(e)
                    if e:
                        here[phrase_of(e)] = None
            ctx_pass.extend([i] * len(here))
            ctx_phrase.extend(here)

        n_phr = len(phrases)
        facts = list(fact_ids)
        ctx_phrase_arr = np.asarray(ctx_phrase, dtype=np.int64)
        phrase_passage_count = np.bincount(ctx_phrase_arr, minlength=n_phr) if n_phr else np.zeros(0, np.int64)

        syn_src = np.zeros(0, np.int64)
        syn_dst = np.zeros(0, np.int64)
        syn_w = np.zeros(0)
        fact_embeddings = None
        if embedder is not None:
            cache = cache if cache is not None else EmbeddingCache()
            if config.synonyms and n_phr > 1:
                phrase_vecs = cache.encode(embedder, phrases, kind="phrase", precision=precision, show_progress=show_progress)
                syn_src, syn_dst, syn_w = synonym_pairs(phrases, phrase_vecs, config.synonym_threshold, config.synonym_max_neighbors)
            fact_embeddings = cache.encode(
                embedder, [cls.fact_text(f) for f in facts], kind="fact", precision=precision, show_progress=show_progress
            )

        src = np.concatenate([
            n_pass + np.asarray(rel_src, dtype=np.int64),
            np.asarray(ctx_pass, dtype=np.int64),
            n_pass + syn_src,
        ])
        dst = np.concatenate([n_pass + np.asarray(rel_dst, dtype=np.int64), n_pass + ctx_phrase_arr, n_pass + syn_dst])
        weights = np.concatenate([
            np.full(len(rel_src), config.relation_weight),
            np.full(len(ctx_pass), config.context_weight),
            syn_w,
        ])
        csr = CSRGraph.from_edges(n_pass + n_phr, src, dst, weights, symmetric=True)
        stats = {
            "passage_nodes": n_pass,
            "phrase_nodes": n_phr,
            "nodes": n_pass + n_phr,
            "facts": len(facts),
            "relation_edges": int(len(set(zip(rel_src, rel_dst)))),
            "context_edges": int(len(ctx_pass)),
            "synonymy_edges": int(len(syn_w)),
            "nnz": csr.nnz,
            "dropped_triples": dropped,
            "passages_without_triples": int(n_pass - len(set(ctx_pass))),
        }
        return cls(n_pass, phrases, phrase_passage_count, facts, np.asarray(fact_nodes, np.int64), csr, fact_embeddings, config, stats)

    # ------------------------------------------------------------------ query-time seeding

    def seed_weights(
        self,
        fact_scores: np.ndarray,
        dense_scores: np.ndarray,
        *,
        link_top_k: int = 5,
        passage_node_weight: float = 0.05,
    ) -> tuple[np.ndarray, list[list[tuple[int, float]]]]:
        """Personalization vectors for PPR, one row per query.

        1. Fact scores (cosine of query and fact text) are min-max scaled per query; the top
           ``link_top_k`` facts are kept.
        2. Each subject/object phrase of a kept fact gets the mean scaled score of the kept facts
           it appears in; only the ``link_top_k`` best phrases stay. A phrase's weight is then
           divided by the number of passages it occurs in, so a phrase that appears everywhere
           ("united states") does not flood the walk.
        3. Every passage node gets its min-max scaled dense score times ``passage_node_weight``.

        Returns ``(reset [B, nodes] float32, kept facts per query as (fact index, cosine))``.
        """
        fact_scores = np.atleast_2d(np.asarray(fact_scores, dtype=np.float32))
        dense_scores = np.atleast_2d(np.asarray(dense_scores, dtype=np.float32))
        batch = dense_scores.shape[0]
        # Fortran order: the PPR engine wants [nodes, batch] and gets it without a transpose.
        reset = np.zeros((batch, self.n_nodes), dtype=np.float32, order="F")
        reset[:, : self.n_passages] = min_max(dense_scores, axis=1) * passage_node_weight
        kept: list[list[tuple[int, float]]] = []
        n_facts = fact_scores.shape[1] if fact_scores.size else 0
        for b in range(batch):
            if n_facts == 0 or link_top_k <= 0:
                kept.append([])
                continue
            raw = fact_scores[b]
            scaled = min_max(raw)
            top = min(link_top_k, n_facts)
            idx = np.argpartition(-scaled, top - 1)[:top] if top < n_facts else np.arange(n_facts)
            idx = idx[np.lexsort((idx, -scaled[idx]))]
            kept.append([(int(f), float(raw[f])) for f in idx])
            per_phrase: dict[int, list[float]] = {}
            for f in idx:
                for node in self.fact_nodes[f]:
                    per_phrase.setdefault(int(node), []).append(float(scaled[f]))
            ranked = sorted(per_phrase.items(), key=lambda kv: (-float(np.mean(kv[1])), kv[0]))[:link_top_k]
            for node, scores in ranked:
                count = max(1, int(self.phrase_passage_count[node - self.n_passages]))
                reset[b, node] += float(np.mean(scores)) / count
        empty = reset.sum(axis=1) <= 0
        if empty.any():  # e.g. passage_node_weight=0 and no facts: fall back to uniform passages
            reset[empty, : self.n_passages] = 1.0
        return reset, kept

    # ------------------------------------------------------------------ persistence

    def save(self, root: Path, prefix: str = "graph") -> dict:
        folder = root / prefix
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / "indptr.npy", self.csr.indptr, allow_pickle=False)
        np.save(folder / "indices.npy", self.csr.indices, allow_pickle=False)
        np.save(folder / "weights.npy", self.csr.weights, allow_pickle=False)
        write_table(folder / "phrases.parquet", {"phrase": self.phrases, "passage_count": self.phrase_passage_count})
        write_table(folder / "facts.parquet", {
            "subject": [f[0] for f in self.facts],
            "relation": [f[1] for f in self.facts],
            "object": [f[2] for f in self.facts],
            "subject_node": self.fact_nodes[:, 0],
            "object_node": self.fact_nodes[:, 1],
        })
        if self.fact_embeddings is not None:
            np.save(folder / "fact_embeddings.npy", self.fact_embeddings, allow_pickle=False)
        meta = {"n_passages": self.n_passages, "config": asdict(self.config), "stats": self.stats,
                "has_fact_embeddings": self.fact_embeddings is not None}
        (folder / "graph.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
        return meta

    @classmethod
    def load(cls, root: Path, prefix: str = "graph") -> "KnowledgeGraph":
        folder = root / prefix
        try:
            meta = json.loads((folder / "graph.json").read_text(encoding="utf-8"))
            config = GraphConfig(**meta["config"]).validate()
            n_pass = int(meta["n_passages"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise IndexFormatError(f"{folder}: unreadable graph metadata ({e})") from None
        rel = prefix + "/"
        indptr = load_npy(root, rel + "indptr.npy", dtype=np.int64, ndim=1)
        indices = load_npy(root, rel + "indices.npy", ndim=1)
        weights = load_npy(root, rel + "weights.npy", dtype=np.float64, ndim=1)
        phrases_t = read_table(root, rel + "phrases.parquet", ("phrase", "passage_count"))
        facts_t = read_table(root, rel + "facts.parquet", ("subject", "relation", "object", "subject_node", "object_node"))
        phrases = phrases_t["phrase"]
        n_nodes = n_pass + len(phrases)
        csr = CSRGraph(indptr, indices, weights)
        try:
            if csr.n != n_nodes:
                raise ValueError(f"CSR has {csr.n} nodes but the node tables list {n_nodes}")
            csr.validate()
        except ValueError as e:
            raise IndexFormatError(f"{folder}: inconsistent graph ({e})") from None
        facts = list(zip(facts_t["subject"], facts_t["relation"], facts_t["object"]))
        fact_nodes = np.stack([np.asarray(facts_t["subject_node"], np.int64), np.asarray(facts_t["object_node"], np.int64)], axis=1) if facts else np.zeros((0, 2), np.int64)
        if len(facts) and (fact_nodes.min() < n_pass or fact_nodes.max() >= n_nodes):
            raise IndexFormatError(f"{folder}: fact endpoints point outside the phrase nodes")
        fact_embeddings = None
        if meta.get("has_fact_embeddings"):
            fact_embeddings = load_npy(root, rel + "fact_embeddings.npy", dtype=np.float32, ndim=2)
            if fact_embeddings.shape[0] != len(facts):
                raise IndexFormatError(f"{folder}: {fact_embeddings.shape[0]} fact embeddings for {len(facts)} facts")
        return cls(n_pass, phrases, np.asarray(phrases_t["passage_count"], np.int64), facts, fact_nodes, csr,
                   fact_embeddings, config, meta.get("stats", {}))


def synonym_pairs(phrases: list[str], vectors: np.ndarray, threshold: float, max_neighbors: int):
    """Unordered phrase pairs with cosine >= threshold, via an exact FAISS inner-product search."""
    # faiss is imported on use: `import raggym, envs` does not need it.
    import faiss

    eligible = np.array([_alnum_count(p) > 2 for p in phrases])
    rows = np.flatnonzero(eligible)
    if len(rows) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    vecs = np.ascontiguousarray(vectors[rows], dtype=np.float32)
    index = faiss.IndexFlatIP(vecs.shape[1])
    index.add(vecs)
    k = min(max_neighbors + 1, len(rows))
    pairs: dict[tuple[int, int], float] = {}
    for start in range(0, len(rows), 4096):
        sims, nbrs = index.search(vecs[start : start + 4096], k)
        q = np.repeat(np.arange(start, start + len(sims)), k)
        s, n = sims.ravel(), nbrs.ravel()
        ok = (n >= 0) & (n != q) & (s >= threshold)
        for a, b, w in zip(rows[q[ok]], rows[n[ok]], s[ok]):
            key = (int(a), int(b)) if a < b else (int(b), int(a))
            if w > pairs.get(key, -2.0):
                pairs[key] = float(w)
    if not pairs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    keys = np.array(list(pairs), dtype=np.int64)
    return keys[:, 0], keys[:, 1], np.array(list(pairs.values()))
