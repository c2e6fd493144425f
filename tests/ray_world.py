"""Fixtures shared by the modules that run the rollout path on a local Ray instance.

Imported by name into each module (``from ray_world import ray_session, sharded_index``), so
each module gets its own Ray instance and index (module scope) under ``pytest -n 2``.
"""

import pytest
import ray

from raggym.retrieval import Retriever


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def sharded_index(tmp_path_factory, small_world):
    """The small world's saved index (dense in 2 shards + knowledge graph)."""
    d = tmp_path_factory.mktemp("idx") / "world"
    Retriever.build(small_world.corpus, openie=small_world.openie, shards=2, show_progress=False).save(d)
    return d
