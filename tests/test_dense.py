"""Dense FAISS index: exact search, exact sharding (ties included), ANN recall, persistence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raggym.retrieval.dense import DenseConfig, DenseIndex, merge_topk
from raggym.retrieval.storage import IndexFormatError


def brute_force(vectors: np.ndarray, queries: np.ndarray, k: int):
    """Canonical top-k by numpy: score descending, then row ascending."""
    scores = queries.astype(np.float64) @ vectors.astype(np.float64).T
    rows = np.stack([np.lexsort((np.arange(len(s)), -s))[:k] for s in scores])
    return np.take_along_axis(scores, rows, axis=1), rows


def test_merge_topk_by_hand():
    # Two shards; rows 3 and 7 tie at 0.9, so the smaller row comes first. -1 is FAISS padding.
    shard_a = (np.array([[0.9, 0.5]], np.float32), np.array([[7, 1]]))
    shard_b = (np.array([[0.95, 0.9, 0.1]], np.float32), np.array([[4, 3, -1]]))
    scores, rows = merge_topk([shard_a, shard_b], 4)
    assert rows.tolist() == [[4, 3, 7, 1]]
    np.testing.assert_allclose(scores, [[0.95, 0.9, 0.9, 0.5]])
    scores, rows = merge_topk([shard_b], 4)  # fewer valid entries than k: padded
    assert rows.tolist() == [[4, 3, -1, -1]]


def test_flat_matches_brute_force():
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((500, 32)).astype(np.float32)
    queries = rng.standard_normal((7, 32)).astype(np.float32)
    index = DenseIndex.build(vecs)
    scores, rows = index.search(queries, 10)
    ref_scores, ref_rows = brute_force(vecs, queries, 10)
    assert (rows == ref_rows).all()
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)
    assert (index.cost(queries) == 500).all()  # exact search scans every vector


# Small integer vectors: inner products are exact in float32 and ties are frequent, which is the
# hard case for "sharded top-k == unsharded top-k".
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 120),
    dim=st.integers(1, 6),
    shards=st.integers(1, 7),
    nq=st.integers(1, 25),  # FAISS switches to BLAS at 20 queries: cover both paths
    k_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_sharded_equals_unsharded_exactly(n, dim, shards, nq, k_frac, seed):
    shards = min(shards, n)
    rng = np.random.default_rng(seed)
    vecs = rng.integers(-2, 3, size=(n, dim)).astype(np.float32)
    queries = rng.integers(-2, 3, size=(nq, dim)).astype(np.float32)
    k = max(1, int(round(k_frac * n)))
    one = DenseIndex.build(vecs, shards=1)
    many = DenseIndex.build(vecs, shards=shards)
    s1, r1 = one.search(queries, k)
    s2, r2 = many.search(queries, k)
    assert (r1 == r2).all()
    assert (s1 == s2).all()  # bit-identical scores
    ref_scores, ref_rows = brute_force(vecs, queries, k)
    assert (r1 == ref_rows).all()
    np.testing.assert_array_equal(s1, ref_scores.astype(np.float32))
    # A per-shard search (what a Ray shard actor returns) merges to the same answer.
    parts = [many.search_shard(s, queries, k) for s in range(shards)]
    s3, r3 = merge_topk(parts, k)
    assert (r3 == r1).all() and (s3 == s1).all()


def test_all_ties_are_resolved_by_row():
    vecs = np.ones((50, 4), np.float32)
    index = DenseIndex.build(vecs, shards=3)
    _, rows = index.search(np.ones((2, 4), np.float32), 5)
    assert rows.tolist() == [[0, 1, 2, 3, 4]] * 2


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_ann_recall_against_exact(kind):
    rng = np.random.default_rng(1)
    vecs = rng.standard_normal((2000, 24)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    queries = vecs[:50] + 0.1 * rng.standard_normal((50, 24)).astype(np.float32)
    exact = DenseIndex.build(vecs)
    ann = DenseIndex.build(vecs, kind=kind)
    _, r_exact = exact.search(queries, 10)
    _, r_ann = ann.search(queries, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(r_exact, r_ann)])
    assert recall >= 0.8, f"{kind} recall@10 vs exact = {recall}"
    cost = ann.cost(queries)
    assert (cost > 0).all() and (cost < 2000).all()  # an ANN index scans less than everything
    np.testing.assert_array_equal(cost, ann.cost(queries))  # and the count is deterministic


def test_save_load_roundtrip(tmp_path: Path):
    rng = np.random.default_rng(2)
    vecs = rng.standard_normal((300, 16)).astype(np.float32)
    for kind in ("flat", "hnsw"):
        index = DenseIndex.build(vecs, kind=kind, shards=3)
        index.save(tmp_path / kind)
        loaded = DenseIndex.load(tmp_path / kind)
        q = rng.standard_normal((4, 16)).astype(np.float32)
        a, b = index.search(q, 7), loaded.search(q, 7)
        assert (a[1] == b[1]).all() and (a[0] == b[0]).all()
        assert loaded.config == index.config


def test_corrupted_shard_is_a_clear_error(tmp_path: Path):
    vecs = np.random.default_rng(3).standard_normal((40, 8)).astype(np.float32)
    DenseIndex.build(vecs, shards=2).save(tmp_path)
    (tmp_path / "dense" / "shard-001.faiss").write_bytes(b"not a faiss index")
    with pytest.raises(IndexFormatError, match="shard-001"):
        DenseIndex.load(tmp_path)
    (tmp_path / "dense" / "offsets.npy").unlink()
    with pytest.raises(ValueError, match="offsets"):
        DenseIndex.load(tmp_path)


def test_bad_arguments():
    vecs = np.ones((5, 3), np.float32)
    with pytest.raises(ValueError, match="shards"):
        DenseIndex.build(vecs, shards=6)
    with pytest.raises(ValueError, match="kind"):
        DenseIndex.build(vecs, kind="lsh")
    with pytest.raises(ValueError, match="NaN"):
        DenseIndex.build(np.full((2, 3), np.nan, np.float32))
    index = DenseIndex.build(vecs)
    with pytest.raises(ValueError, match="k must"):
        index.search(np.ones((1, 3), np.float32), 0)
    with pytest.raises(ValueError, match="shape"):
        index.search(np.ones((1, 4), np.float32), 1)
    assert DenseConfig().kind == "flat"


@pytest.mark.parametrize("nq", [3, 40])
def test_sharded_scores_bit_identical_on_float_vectors(nq):
    rng = np.random.default_rng(4)
    vecs = rng.standard_normal((1000, 48)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    queries = rng.standard_normal((nq, 48)).astype(np.float32)
    s1, r1 = DenseIndex.build(vecs).search(queries, 20)
    for shards in (2, 5):
        s2, r2 = DenseIndex.build(vecs, shards=shards).search(queries, 20)
        assert (r1 == r2).all() and (s1 == s2).all()
