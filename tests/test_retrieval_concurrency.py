"""The retrieval service serves concurrent calls in parallel across its graph replicas.

Each replica is the real ``GraphReplica`` with a fixed extra delay per call (a subclass) that records
the wall-clock interval of every ranking it serves. Two concurrent calls through a service with two
replicas must be spread over both replicas and their rankings must run at the same time (overlapping
intervals): a service that serialised graph calls would run the second ranking only after the first
one ended, however fast or loaded the machine. Both calls must return exactly what the in-process
retriever returns.
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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.intervals = []  # (start, end) wall-clock seconds of each ranking served

    def graph_rank(self, queries, k):
        started = time.time()  # wall clock: comparable across the replica processes of one machine
        time.sleep(DELAY_S)
        ranked = super().graph_rank(queries, k)
        self.intervals.append((started, time.time()))
        return ranked

    def served_intervals(self):
        return list(self.intervals)


# The replica class travels to the actor processes by value: they cannot import a test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _intervals(replicas):
    return [ray.get(r.served_intervals.remote(), timeout=60) for r in replicas]


def test_two_slow_graph_calls_overlap_on_two_replicas(ray_session, sharded_index, small_world):
    service, shards, replicas = start_retrieval_service(str(sharded_index), num_replicas=2, replica_class=SlowGraphReplica)
    assert len(replicas) == 2
    first, second = [q.question for q in small_world.questions[:2]], [q.question for q in small_world.questions[2:4]]
    ray.get([service.retrieve.remote(first, "graph", 3)], timeout=120)  # warm up: embedder and actors loaded
    before = [len(served) for served in _intervals(replicas)]
    got_first, got_second = ray.get([service.retrieve.remote(first, "graph", 3),
                                     service.retrieve.remote(second, "graph", 3)], timeout=120)
    new = [served[n:] for served, n in zip(_intervals(replicas), before)]
    assert all(new), f"a replica served none of the two calls' rankings: {new}"
    assert all(end - start >= DELAY_S for served in new for start, end in served)
    # served one after the other, no ranking on one replica would run while one ran on the other
    overlap = max(min(end_a, end_b) - max(start_a, start_b) for start_a, end_a in new[0] for start_b, end_b in new[1])
    assert overlap > 0, f"the two calls' rankings did not run at the same time: {new}"
    local = Retriever.load(sharded_index)
    for got, queries in ((got_first, first), (got_second, second)):
        expected = local.retrieve(queries, "graph", 3)
        assert [r.ids for r in got] == [r.ids for r in expected]
    assert ray.get(service.stats.remote())["calls"] == 3
