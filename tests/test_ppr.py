"""Batched torch PPR against hand-solved cases and the igraph (prpack) reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raggym.retrieval.ppr import CSRGraph, IgraphPPR, TorchPPR, top_k_rows

# igraph (a dev dependency, installed by `make install`) is imported by IgraphPPR only: the tests
# that compare against it fail without it, and the pure-torch tests do not depend on it.


def assert_same_topk(expected: np.ndarray, actual: np.ndarray, k: int = 10, tie_tol: float = 1e-9):
    """Top-k ids identical, except that ids whose reference scores tie (within tie_tol) may swap."""
    exp_rows = top_k_rows(expected, k)
    act_rows = top_k_rows(actual, k)
    for b in range(expected.shape[0]):
        for pos, (e, a) in enumerate(zip(exp_rows[b], act_rows[b])):
            if e != a:
                assert abs(expected[b, e] - expected[b, a]) <= tie_tol, (
                    f"query {b} rank {pos}: reference {e} ({expected[b, e]:.8g}) vs torch {a} ({expected[b, a]:.8g})"
                )


def test_three_node_path_solved_by_hand():
    # Path 0 - 1 - 2, damping 1/2, reset on node 0. Balance equations:
    #   p0 = 1/2 + 1/2 * (p1 / 2),  p1 = 1/2 * (p0 + p2),  p2 = 1/2 * (p1 / 2)
    # give p = (7/12, 4/12, 1/12).
    g = CSRGraph.from_edges(3, [0, 1], [1, 2])
    expected = np.array([7 / 12, 1 / 3, 1 / 12])
    torch_scores = TorchPPR(g, 0.5, dtype=_float64(), threads=1).run(np.array([1.0, 0.0, 0.0]), tol=1e-12).scores[0]
    np.testing.assert_allclose(torch_scores, expected, atol=1e-10)
    np.testing.assert_allclose(IgraphPPR(g, 0.5).run_one(np.array([1.0, 0.0, 0.0])), expected, atol=1e-10)


def test_dangling_node_mass_returns_to_reset():
    # Edge 0-1 and an isolated (dangling) node 2; reset r = (1/2, 0, 1/2), damping 1/2.
    # Mass leaving node 2 returns along r, so the teleport mass is c = 1/2 + p2/2 and
    #   p0 = p1/2 + c/2,  p1 = p0/2,  p2 = c/2   =>   p = (4/9, 2/9, 1/3).
    g = CSRGraph.from_edges(3, [0], [1])
    res = TorchPPR(g, 0.5, dtype=_float64(), threads=1).run(np.array([0.5, 0.0, 0.5]), tol=1e-12)
    np.testing.assert_allclose(res.scores[0], [4 / 9, 2 / 9, 1 / 3], atol=1e-10)
    np.testing.assert_allclose(IgraphPPR(g).run_one(np.array([0.5, 0.0, 0.5])), [4 / 9, 2 / 9, 1 / 3], atol=1e-10)


def _float64():
    import torch

    return torch.float64


def _random_graph(rng, n, m):
    src = rng.integers(0, n, m)
    dst = rng.integers(0, n, m)
    return CSRGraph.from_edges(n, src, dst, rng.random(m) + 0.05)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 40),
    density=st.floats(0.2, 3.0),
    seed=st.integers(0, 2**32 - 1),
    damping=st.sampled_from([0.5, 0.85, 0.3]),
)
def test_matches_igraph_on_random_graphs(n, density, seed, damping):
    rng = np.random.default_rng(seed)
    g = _random_graph(rng, n, max(1, int(density * n)))
    reset = rng.random((3, n)) * (rng.random((3, n)) < 0.5)
    reset[:, rng.integers(0, n)] += 0.1  # never all-zero
    ref = IgraphPPR(g, damping).run(reset)
    got = TorchPPR(g, damping, threads=1).run(reset)
    np.testing.assert_allclose(got.scores, ref, atol=1e-5)
    np.testing.assert_allclose(got.scores.sum(1), 1.0, atol=1e-5)  # a probability distribution
    assert got.converged.all()
    assert_same_topk(ref, got.scores, k=min(10, n), tie_tol=1e-6)


def test_matches_igraph_on_musique_graph(musique_dir):
    """The real MuSiQue OpenIE graph (structure only), 64 HippoRAG-like resets at once."""
    from raggym.data import load_corpus
    from raggym.retrieval.graph import KnowledgeGraph
    from raggym.retrieval.openie_io import align_openie

    corpus = load_corpus(musique_dir / "corpus.json")
    kg = KnowledgeGraph.build(align_openie(musique_dir / "openie_gpt-3.5-turbo-1106.json", corpus).per_passage)
    rng = np.random.default_rng(0)
    reset = np.zeros((64, kg.n_nodes))
    reset[:, : kg.n_passages] = rng.random((64, kg.n_passages)) * 0.05  # dense-score seeds
    for b in range(64):  # a handful of phrase seeds, as fact linking would give
        reset[b, kg.n_passages + rng.choice(len(kg.phrases), 5, replace=False)] = rng.random(5)
    ref = IgraphPPR(kg.csr, 0.5).run(reset[:16])
    got = TorchPPR(kg.csr, 0.5, threads=1).run(reset)
    np.testing.assert_allclose(got.scores[:16], ref, atol=1e-5)
    passages = np.arange(kg.n_passages)
    assert (top_k_rows(ref[:, passages], 10) == top_k_rows(got.scores[:16][:, passages], 10)).all()


def test_batch_does_not_change_a_query():
    rng = np.random.default_rng(3)
    g = _random_graph(rng, 300, 900)
    reset = rng.random((5, 300))
    eng = TorchPPR(g, threads=1)
    together = eng.run(reset)
    alone = eng.run(reset[2:3])
    np.testing.assert_allclose(together.scores[2], alone.scores[0], atol=1e-7)
    assert together.iterations[2] == alone.iterations[0]  # per-query cost is deterministic


def test_node_subset_and_convergence_bound():
    rng = np.random.default_rng(4)
    g = _random_graph(rng, 200, 600)
    eng = TorchPPR(g, tol=1e-6, threads=1)
    full = eng.run(rng.random((2, 200)))
    # With damping 1/2 the a-priori bound (1/2)^(k+1) <= 1e-6 caps the iterations at 19.
    assert (full.iterations <= 19).all() and full.converged.all()
    assert eng.a_priori_iterations(1e-5) == 16 and eng.a_priori_iterations(1e-6) == 19
    subset = eng.run(rng.random((2, 200)), nodes=np.arange(10))
    assert subset.scores.shape == (2, 10)


@pytest.mark.parametrize(
    "reset, message",
    [
        (np.zeros((1, 5)), "all zeros"),
        (np.full((1, 5), -1.0), "non-negative"),
        (np.full((1, 5), np.nan), "finite"),
        (np.ones((1, 4)), "shape"),
    ],
)
def test_bad_reset_vectors_raise(reset, message):
    g = CSRGraph.from_edges(5, [0, 1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match=message):
        TorchPPR(g).run(reset)


def test_csr_from_edges_merges_and_validates():
    g = CSRGraph.from_edges(3, [0, 0, 1, 2], [1, 1, 2, 2], [1.0, 2.0, 1.0, 5.0])  # parallel edge, self-loop
    assert g.nnz == 4  # 0-1 (weight 3) and 1-2 (weight 1), both directions; the loop 2-2 is dropped
    assert g.is_symmetric()
    np.testing.assert_allclose(g.out_strength(), [3.0, 4.0, 1.0])
    with pytest.raises(ValueError):
        CSRGraph.from_edges(3, [0], [5])
    with pytest.raises(ValueError):
        CSRGraph.from_edges(3, [0], [1], [-1.0])
    with pytest.raises(ValueError, match="damping"):
        TorchPPR(g, damping=1.0)


def test_directed_graph_matches_igraph():
    rng = np.random.default_rng(5)
    g = CSRGraph.from_edges(30, rng.integers(0, 30, 80), rng.integers(0, 30, 80), rng.random(80) + 0.1, symmetric=False)
    reset = rng.random((2, 30))
    ref = IgraphPPR(g, 0.5, directed=True).run(reset)
    np.testing.assert_allclose(TorchPPR(g, 0.5).run(reset).scores, ref, atol=1e-5)
