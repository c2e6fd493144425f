"""Dense passage index over FAISS: exact inner product by default, optional HNSW/IVF, exact sharding.

Ranking contract. A search returns, per query, the k rows with the highest inner product,
ordered by (score descending, row ascending). The row tie-break makes the answer unique, and that
uniqueness is what lets a sharded search equal the unsharded one *exactly*: every shard returns
its own canonical top-k, and ``merge_topk`` re-sorts the union with the same key. FAISS itself
breaks ties at the k-th position arbitrarily, so ``_canonical_topk`` widens the request until the
k-th score is strictly above the last score FAISS returned (or the shard is exhausted); only then
is every tied row known.

Rows are global passage positions; shard ``s`` holds the contiguous rows
``[offsets[s], offsets[s+1])``. The Ray layer can put one shard per actor and reuse
``merge_topk`` unchanged.

Cost (deterministic work units per query): the number of vectors whose inner product with the
query was computed. Flat: all of them. IVF: the sizes of the probed lists. HNSW: FAISS's
distance-computation counter for that query alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .storage import IndexFormatError

INDEX_KINDS = ("flat", "hnsw", "ivf")


def _faiss():
    import faiss

    return faiss


@dataclass(frozen=True)
class DenseConfig:
    kind: str = "flat"
    shards: int = 1
    hnsw_m: int = 32
    hnsw_ef_construction: int = 200
    hnsw_ef_search: int = 128
    ivf_nlist: int | None = None  # default: about 4 * sqrt(rows per shard)
    ivf_nprobe: int = 16

    def validate(self) -> "DenseConfig":
        if self.kind not in INDEX_KINDS:
            raise ValueError(f"unknown dense index kind {self.kind!r}; expected one of {', '.join(INDEX_KINDS)}")
        if not isinstance(self.shards, int) or self.shards < 1:
            raise ValueError(f"shards must be a positive integer, got {self.shards!r}")
        return self


def merge_topk(parts: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge per-shard ``(scores [q, k_i], rows [q, k_i])`` into the canonical global top-k.

    Rows must already be global. Entries with row < 0 (FAISS padding) are dropped. The result is
    ordered by (score descending, row ascending); missing slots are padded with (-inf, -1).
    """
    if not parts:
        raise ValueError("merge_topk needs at least one part")
    scores = np.concatenate([np.asarray(s, dtype=np.float32) for s, _ in parts], axis=1)
    rows = np.concatenate([np.asarray(r, dtype=np.int64) for _, r in parts], axis=1)
    scores = np.where(rows < 0, -np.inf, scores).astype(np.float32)
    # Invalid rows sort after every valid one: their row key is pushed past any real row.
    row_key = np.where(rows < 0, np.iinfo(np.int64).max, rows)
    order = np.lexsort((row_key, -scores.astype(np.float64)), axis=-1)[:, :k]
    out_scores = np.take_along_axis(scores, order, axis=1)
    out_rows = np.take_along_axis(rows, order, axis=1)
    out_rows = np.where(np.isfinite(out_scores), out_rows, -1)
    if out_scores.shape[1] < k:
        pad = k - out_scores.shape[1]
        out_scores = np.pad(out_scores, ((0, 0), (0, pad)), constant_values=-np.inf)
        out_rows = np.pad(out_rows, ((0, 0), (0, pad)), constant_values=-1)
    return out_scores, out_rows


def _canonical_topk(index, queries: np.ndarray, k: int, ntotal: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of one FAISS index in canonical (score desc, row asc) order, ties fully resolved."""
    nq = queries.shape[0]
    k_eff = min(k, ntotal)
    if k_eff == 0 or nq == 0:
        return np.full((nq, k), -np.inf, np.float32), np.full((nq, k), -1, np.int64)
    want = min(k_eff + 1, ntotal)
    scores, rows = index.search(queries, want)
    pending = np.arange(nq)
    final_s = np.empty((nq, want), np.float32)
    final_r = np.empty((nq, want), np.int64)
    while True:
        s, r = scores, rows
        complete = (want >= ntotal) | (s[:, k_eff - 1] > s[:, want - 1]) | (r[:, want - 1] < 0)
        if final_s.shape[1] != want:  # widen the holding arrays after a re-query
            final_s = np.pad(final_s, ((0, 0), (0, want - final_s.shape[1])), constant_values=-np.inf)
            final_r = np.pad(final_r, ((0, 0), (0, want - final_r.shape[1])), constant_values=-1)
        final_s[pending] = s
        final_r[pending] = r
        pending = pending[~complete]
        if pending.size == 0:
            break
        want = min(want * 2, ntotal)
        scores, rows = index.search(np.ascontiguousarray(queries[pending]), want)
    return merge_topk([(final_s, final_r)], k)


class DenseIndex:
    """FAISS index over passage vectors, split into ``config.shards`` contiguous shards."""

    def __init__(self, shards: list, offsets: np.ndarray, dim: int, config: DenseConfig):
        self.shards = shards
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.dim = int(dim)
        self.config = config

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(cls, vectors: np.ndarray, config: DenseConfig | None = None, **overrides) -> "DenseIndex":
        config = (config or DenseConfig(**overrides)).validate()
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] == 0:
            raise ValueError(f"need a non-empty [n, dim] array of vectors, got shape {vectors.shape}")
        if not np.isfinite(vectors).all():
            raise ValueError("passage vectors contain NaN or infinity")
        n, dim = vectors.shape
        if config.shards > n:
            raise ValueError(f"cannot split {n} vectors into {config.shards} shards")
        offsets = np.linspace(0, n, config.shards + 1).round().astype(np.int64)
        shards = [cls._make_shard(vectors[offsets[s] : offsets[s + 1]], config) for s in range(config.shards)]
        return cls(shards, offsets, dim, config)

    @staticmethod
    def _make_shard(block: np.ndarray, config: DenseConfig):
        faiss = _faiss()
        dim = block.shape[1]
        if config.kind == "flat":
            index = faiss.IndexFlatIP(dim)
        elif config.kind == "hnsw":
            index = faiss.IndexHNSWFlat(dim, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = config.hnsw_ef_construction
            index.hnsw.efSearch = config.hnsw_ef_search
        else:
            nlist = config.ivf_nlist or max(1, int(round(4 * np.sqrt(block.shape[0]))))
            nlist = min(nlist, block.shape[0])
            quantizer = faiss.IndexFlatIP(dim)
            index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
            index.train(block)
            index.nprobe = min(config.ivf_nprobe, nlist)  # faiss's wrapper keeps `quantizer` alive
        index.add(block)
        return index

    # ------------------------------------------------------------------ queries

    @property
    def ntotal(self) -> int:
        return int(self.offsets[-1])

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(scores [q, k] float32, rows [q, k] int64)`` in canonical order."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must have shape [q, {self.dim}], got {queries.shape}")
        if not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        parts = []
        for s, shard in enumerate(self.shards):
            size = int(self.offsets[s + 1] - self.offsets[s])
            sc, rows = _canonical_topk(shard, queries, int(k), size)
            parts.append((sc, np.where(rows >= 0, rows + self.offsets[s], -1)))
        return merge_topk(parts, int(k))

    def search_shard(self, shard: int, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One shard's canonical top-k with global rows (what a per-shard actor would return)."""
        size = int(self.offsets[shard + 1] - self.offsets[shard])
        sc, rows = _canonical_topk(self.shards[shard], np.ascontiguousarray(queries, dtype=np.float32), int(k), size)
        return sc, np.where(rows >= 0, rows + self.offsets[shard], -1)

    def cost(self, queries: np.ndarray) -> np.ndarray:
        """Vectors scanned per query (deterministic; see the module docstring)."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        nq = queries.shape[0]
        if self.config.kind == "flat":
            return np.full(nq, float(self.ntotal))
        faiss = _faiss()
        total = np.zeros(nq)
        for shard in self.shards:
            if self.config.kind == "ivf":
                ivf = faiss.extract_index_ivf(shard)
                _, lists = ivf.quantizer.search(queries, ivf.nprobe)
                sizes = np.array([ivf.invlists.list_size(int(i)) if i >= 0 else 0 for i in lists.ravel()])
                total += sizes.reshape(lists.shape).sum(1) + ivf.nlist  # lists probed + centroids
            else:
                stats = faiss.cvar.hnsw_stats
                for i in range(nq):
                    stats.reset()
                    shard.search(queries[i : i + 1], 1)
                    total[i] += stats.ndis
        return total

    # ------------------------------------------------------------------ persistence

    def save(self, root: Path, prefix: str = "dense") -> dict:
        faiss = _faiss()
        folder = root / prefix
        folder.mkdir(parents=True, exist_ok=True)
        for s, shard in enumerate(self.shards):
            faiss.write_index(shard, str(folder / f"shard-{s:03d}.faiss"))
        np.save(folder / "offsets.npy", self.offsets, allow_pickle=False)
        meta = {"dim": self.dim, "config": self.config.__dict__, "ntotal": self.ntotal}
        (folder / "dense.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
        return meta

    @classmethod
    def load(cls, root: Path, prefix: str = "dense") -> "DenseIndex":
        faiss = _faiss()
        folder = root / prefix
        try:
            meta = json.loads((folder / "dense.json").read_text(encoding="utf-8"))
            config = DenseConfig(**meta["config"]).validate()
            dim = int(meta["dim"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise IndexFormatError(f"{folder}: unreadable dense index metadata ({e})") from None
        try:
            offsets = np.load(folder / "offsets.npy", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise IndexFormatError(f"{folder}: unreadable shard offsets ({e})") from None
        if offsets.ndim != 1 or len(offsets) != config.shards + 1 or offsets[0] != 0 or np.any(np.diff(offsets) <= 0):
            raise IndexFormatError(f"{folder}: shard offsets {offsets.tolist()} do not describe {config.shards} shards")
        shards = []
        for s in range(config.shards):
            path = folder / f"shard-{s:03d}.faiss"
            try:
                shard = faiss.read_index(str(path))
            except Exception as e:  # noqa: BLE001 - FAISS raises RuntimeError with C++ text
                raise IndexFormatError(f"{path}: unreadable FAISS index ({str(e).splitlines()[0] if str(e) else e})") from None
            expected = int(offsets[s + 1] - offsets[s])
            if shard.ntotal != expected or shard.d != dim:
                raise IndexFormatError(
                    f"{path}: holds {shard.ntotal} vectors of dim {shard.d}, expected {expected} of dim {dim}"
                )
            if config.kind == "hnsw":
                shard.hnsw.efSearch = config.hnsw_ef_search
            elif config.kind == "ivf":
                faiss.extract_index_ivf(shard).nprobe = config.ivf_nprobe
            shards.append(shard)
        return cls(shards, offsets, dim, config)
