"""The Ray retrieval service returns exactly what the in-process Retriever returns."""

import numpy as np
import pytest
import ray

from actors.retrieval_service import GraphReplica, IndexShard, start_retrieval_service
from raggym.retrieval import Retriever


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory, small_world):
    d = tmp_path_factory.mktemp("idx") / "world"
    Retriever.build(small_world.corpus, openie=small_world.openie, shards=3, show_progress=False).save(d)
    return d


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.query == y.query and x.ids == y.ids
        np.testing.assert_allclose([h.score for h in x.hits], [h.score for h in y.hits], rtol=0, atol=1e-6)
        assert x.cost == y.cost
        # facts: identical triples; link scores equal up to float rounding (thread counts differ)
        assert [f[:3] for f in x.facts] == [f[:3] for f in y.facts]
        np.testing.assert_allclose([f[3] for f in x.facts], [f[3] for f in y.facts], rtol=0, atol=1e-6)


def test_service_matches_in_process_retriever(ray_session, index_dir, small_world):
    local = Retriever.load(index_dir)
    service, shards, replicas = start_retrieval_service(str(index_dir), num_replicas=2, routing="least_loaded")
    assert len(shards) == 3 and len(replicas) == 2
    queries = [q.question for q in small_world.questions[:12]] + ["", "zzzz unknown words"]
    for mode in ("passage", "graph", "hybrid"):
        for k in (1, 3, 7):
            remote = ray.get(service.retrieve.remote(queries, mode, k))
            _same(remote, local.retrieve(queries, mode, k))
            assert all(r.seconds > 0 for r in remote if not r.error)
    grouped = ray.get(service.retrieve_groups.remote([("graph", 3, queries[:4]), ("passage", 2, queries[4:6])]))
    _same(grouped[0], local.retrieve(queries[:4], "graph", 3))
    _same(grouped[1], local.retrieve(queries[4:6], "passage", 2))
    with pytest.raises(ray.exceptions.RayTaskError, match="unknown retrieval mode"):
        ray.get(service.retrieve.remote(queries, "telepathy", 3))
    assert ray.get(service.stats.remote())["replicas"] == 2  # the service survived the bad call


def test_actor_logic_without_ray(index_dir, small_world):
    """Shard and replica are plain classes: their answers compose into the in-process ones."""
    local = Retriever.load(index_dir)
    q = local.encode_queries([x.question for x in small_world.questions[:5]])
    from raggym.retrieval import merge_topk

    parts = [IndexShard(str(index_dir), s).search(q, 4) for s in range(3)]
    scores, rows = merge_topk(parts, 4)
    ref_scores, ref_rows = local.dense.search(q, 4)
    assert (rows == ref_rows).all() and np.allclose(scores, ref_scores)
    g_rows, g_scores, g_cost, _ = GraphReplica(str(index_dir)).graph_rank(q, 4)
    r_rows, r_scores, r_cost, _ = local._graph_rank(q, 4)
    assert (g_rows == r_rows).all() and np.allclose(g_scores, r_scores) and (g_cost == r_cost).all()
    with pytest.raises(ValueError, match="shard 5 does not exist"):
        IndexShard(str(index_dir), 5)
