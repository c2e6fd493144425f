"""Fixtures shared by the modules that run the rollout path on a local Ray instance.

Imported by name into each module (``from ray_world import ray_session, sharded_index``), so
each module gets its own Ray instance and index (module scope) under ``pytest -n 2``.
"""

import time

import pytest
import ray

from raggym.retrieval import Retriever


def wait_until_restarted(actor, timeout_s: float = 300.0) -> None:
    """Until a killed ``RolloutWorker`` answers from its rebuilt process (``ray.kill`` returns
    before the old process is gone, and calls in between fail as unavailable)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ray.get(actor.info.remote(), timeout=timeout_s)["restarted"]:
                return
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
            pass
        time.sleep(0.2)
    raise AssertionError("the killed worker did not come back")


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
