"""The retrieval service serves concurrent calls in parallel across its graph replicas.

Each replica is the real ``GraphReplica`` with a fixed extra delay per call (a subclass), so one
graph call's duration is known: two concurrent calls through a service with two replicas must take
less than twice one call, and return exactly what the in-process retriever returns.
"""

import sys
import time

import ray
from ray import cloudpickle

from actors.retrieval_service import GraphReplica, start_retrieval_service
from raggym.retrieval import Retriever
from ray_world import ray_session, sharded_index  # noqa: F401  (fixtures)

DELAY_S = 1.5


class SlowGraphReplica(GraphReplica):
    """``GraphReplica`` whose every ranking takes ``DELAY_S`` longer (a replica under heavy load)."""

    def graph_rank(self, queries, k):
        time.sleep(DELAY_S)
        return super().graph_rank(queries, k)


# The replica class travels to the actor processes by value: they cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _timed(calls):
    started = time.perf_counter()
    results = ray.get(calls, timeout=120)
    return time.perf_counter() - started, results


def test_two_slow_graph_calls_overlap_on_two_replicas(ray_session, sharded_index, small_world):
    service, _, replicas = start_retrieval_service(str(sharded_index), num_replicas=2, replica_class=SlowGraphReplica)
    assert len(replicas) == 2
    first, second = [q.question for q in small_world.questions[:2]], [q.question for q in small_world.questions[2:4]]
    ray.get([service.retrieve.remote(first, "graph", 3), service.retrieve.remote(second, "graph", 3)])  # warm up
    one, _ = _timed([service.retrieve.remote(first, "graph", 3)])
    two, (got_first, got_second) = _timed([service.retrieve.remote(first, "graph", 3),
                                           service.retrieve.remote(second, "graph", 3)])
    assert one >= DELAY_S
    # run one after the other, the second call would add a whole DELAY_S (and its overheads) to the first
    assert two < 2 * one and two < one + DELAY_S / 2, f"two concurrent calls took {two:.2f}s, one took {one:.2f}s"
    local = Retriever.load(sharded_index)
    for got, queries in ((got_first, first), (got_second, second)):
        expected = local.retrieve(queries, "graph", 3)
        assert [r.ids for r in got] == [r.ids for r in expected]
    assert ray.get(service.stats.remote())["calls"] == 5
