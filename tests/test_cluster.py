"""actors.cluster.init_ray: a private local Ray unless an address says otherwise; never a second init."""

from __future__ import annotations

import math
import os

import pytest
import ray

from actors.cluster import init_ray


@pytest.fixture
def no_ray(monkeypatch):
    ray.shutdown()  # a session an earlier module left in this worker process: this test needs Ray not running
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield
    ray.shutdown()


def test_local_instance_gets_enough_logical_cpus_and_is_started_once(no_ray):
    with pytest.raises(ValueError, match="num_cpus or min_cpus"):
        init_ray(num_cpus=2, min_cpus=3)
    want = (os.cpu_count() or 1) + 2.5  # more than the cores: fractional actor requests must still fit
    assert init_ray(min_cpus=want) is True
    assert ray.cluster_resources()["CPU"] == math.ceil(want)
    assert init_ray(num_cpus=1) is False  # already running: left as it is
    assert ray.cluster_resources()["CPU"] == math.ceil(want)


@pytest.mark.slow  # starts a Ray head node and then a local instance: about 45 s on two busy cores
def test_ray_address_joins_that_cluster_and_ignores_local_sizes(no_ray, monkeypatch):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        assert init_ray(num_cpus=7) is True
        assert ray.cluster_resources()["CPU"] == 1  # the cluster's CPUs, not num_cpus
        assert ray.get_runtime_context().gcs_address == cluster.address
        ray.shutdown()
        # An explicit "local" wins over RAY_ADDRESS: a private instance of the requested size.
        assert init_ray("local", num_cpus=3) is True
        assert ray.cluster_resources()["CPU"] == 3
    finally:
        ray.shutdown()
        cluster.shutdown()
