"""Dense passage index over FAISS: exact inner product by default, optional HNSW/IVF, exact sharding.

Ranking contract. A search returns, per query, the k rows with the highest inner product,
ordered by (score descending, row ascending). The row tie-break makes the answer unique, and that
uniqueness is what lets a sharded search equal the unsharded one *exactly*: every shard returns
its own canonical top-k, and ``merge_topk`` re-sorts the union with the same key.

Two FAISS behaviours stand in the way, and ``_canonical_topk`` handles both for the exact (flat)
index. FAISS breaks ties at the k-th position arbitrarily, and it computes inner products with
different kernels depending on the batch size (per-query SIMD loops, or BLAS matrix products for
20+ queries; the two differ in the last bits). So each shard asks FAISS for candidates until the
k-th score exceeds the last returned one by more than the float32 rounding bound
``2 * d * 2^-24 * |q| * max|x|`` (or the shard is exhausted), then rescores those candidates with
one fixed float64 routine and sorts them canonically. The final scores therefore depend only on
(query, vector), never on the shard layout, the batch size or the FAISS code path. ANN indexes
(HNSW, IVF) are approximate by design and keep FAISS's scores.

Rows are global passage positions; shard ``s`` holds the contiguous rows
``[offsets[s], offsets[s+1])``. The Ray layer can put one shard per actor and reuse
``merge_topk`` unchanged.

Cost (deterministic work units per query): the number of vectors whose inner product with the
query was computed. Flat: all of them. IVF: the sizes of the probed lists. HNSW: FAISS's
distance-computation counter for that query alone.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .storage import IndexFormatError

INDEX_KINDS = ("flat", "hnsw", "ivf")


def _faiss():
    # faiss is imported on use: `import raggym, envs` does not need it.
    import faiss

    return faiss


@dataclass(frozen=True)
class DenseConfig:
    kind: str = "flat"
    shards: int = 1
    hnsw_m: int = 32
    hnsw_ef_construction: int = 200
    hnsw_ef_search: int = 128
    ivf_nlist: int | None = None  # default: 4 * sqrt(rows per shard), at most rows / 39
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


def exact_scores(queries: np.ndarray, vectors: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Inner products of each query with its candidate rows, by one fixed float64 routine.

    The value for a (query, row) pair never depends on which other rows are scored with it.
    Rows < 0 get -inf.
    """
    safe = np.where(rows >= 0, rows, 0)
    cand = vectors[safe].astype(np.float64)  # [q, m, d]
    scores = np.einsum("qmd,qd->qm", cand, queries.astype(np.float64)).astype(np.float32)
    return np.where(rows >= 0, scores, -np.inf).astype(np.float32)


_NORM_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # FAISS index -> (ntotal, max row norm)


def flat_storage(index) -> tuple[np.ndarray, float] | None:
    """``(zero-copy view of the vectors, largest row norm)`` of a flat FAISS index, else None.

    The norm is cached on the index object, so repeated searches do not rescan the vectors.
    """
    faiss = _faiss()
    flat = faiss.downcast_index(index)
    if not isinstance(flat, faiss.IndexFlat):
        return None
    view = faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d) if flat.ntotal else np.zeros((0, flat.d), np.float32)
    cached = _NORM_CACHE.get(index)
    if cached is None or cached[0] != flat.ntotal:
        cached = (flat.ntotal, _max_row_norm(view))
        _NORM_CACHE[index] = cached
    return view, cached[1]


def search_shard_canonical(index, queries: np.ndarray, k: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Canonical top-k of one FAISS index (e.g. a shard loaded by a Ray actor), rows + ``offset``.

    Merging such results from every shard with ``merge_topk`` equals the unsharded search,
    ids and scores (exact rescoring for flat indexes; see the module docstring).
    """
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    scores, rows = _canonical_topk(index, queries, int(k), int(index.ntotal))
    return scores, np.where(rows >= 0, rows + int(offset), -1)


def _canonical_topk(index, queries: np.ndarray, k: int, ntotal: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of one FAISS index in canonical (score desc, row asc) order, ties fully resolved.

    Flat indexes: candidates are taken with a rounding margin and rescored exactly (module
    docstring). Other kinds: FAISS scores, ties resolved by widening the request.
    """
    with _BlasForBatches():
        return _canonical_topk_inner(index, queries, k, ntotal)


def _canonical_topk_inner(index, queries: np.ndarray, k: int, ntotal: int) -> tuple[np.ndarray, np.ndarray]:
    storage = flat_storage(index)
    vectors, max_norm = storage if storage is not None else (None, 1.0)
    nq = queries.shape[0]
    k_eff = min(k, ntotal)
    if k_eff == 0 or nq == 0:
        return np.full((nq, k), -np.inf, np.float32), np.full((nq, k), -1, np.int64)
    if vectors is not None:
        unit = 2.0 ** -24
        margin = 2.0 * queries.shape[1] * unit * np.linalg.norm(queries.astype(np.float64), axis=1) * max_norm
    else:
        margin = np.zeros(nq)
    want = min(k_eff + 1 if vectors is None else k_eff + 8, ntotal)
    scores, rows = index.search(queries, want)
    pending = np.arange(nq)
    final_s = np.full((nq, want), -np.inf, np.float32)
    final_r = np.full((nq, want), -1, np.int64)
    while True:
        s, r = scores, rows
        complete = (want >= ntotal) | (s[:, k_eff - 1] - margin[pending] > s[:, want - 1]) | (r[:, want - 1] < 0)
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
    if vectors is not None:
        final_s = exact_scores(queries, vectors, final_r)
    return merge_topk([(final_s, final_r)], k)


def _max_row_norm(vectors: np.ndarray, chunk: int = 65536) -> float:
    best = 0.0
    for start in range(0, len(vectors), chunk):
        block = vectors[start : start + chunk].astype(np.float64)
        best = max(best, float(np.sqrt((block * block).sum(1).max())) if len(block) else 0.0)
    return best


class _BlasForBatches:
    """Let FAISS use BLAS for batches of 20+ queries (faiss 1.15's default threshold is 128,000).

    Exact results do not depend on it (candidates are rescored); only speed does.
    """

    def __enter__(self):
        settings = _faiss().cvar
        self.old = settings.distance_compute_blas_threshold
        settings.distance_compute_blas_threshold = 20
        return self

    def __exit__(self, *exc):
        _faiss().cvar.distance_compute_blas_threshold = self.old
        return False


class DenseIndex:
    """FAISS index over passage vectors, split into ``config.shards`` contiguous shards."""

    def __init__(self, shards: list, offsets: np.ndarray, dim: int, config: DenseConfig):
        self.shards = shards
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.dim = int(dim)
        self.config = config
        for shard in shards:
            flat_storage(shard)  # compute and cache the norm bound once, at build/load time

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
            # 4 sqrt(n) lists, but at least 39 training points per centroid (FAISS's minimum)
            nlist = config.ivf_nlist or max(1, min(int(round(4 * np.sqrt(block.shape[0]))), block.shape[0] // 39))
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
        parts = [self.search_shard(s, queries, int(k)) for s in range(len(self.shards))]
        return merge_topk(parts, int(k))

    def search_shard(self, shard: int, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One shard's canonical top-k with global rows (what a per-shard actor would return)."""
        return search_shard_canonical(self.shards[shard], queries, k, int(self.offsets[shard]))

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
