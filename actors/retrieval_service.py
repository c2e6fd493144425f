"""Retrieval as Ray actors: FAISS shards, knowledge-graph replicas and a fan-out service.

- ``IndexShard``: one FAISS shard of a saved index (``dense/shard-NNN.faiss``); answers its
  canonical top-k with global row numbers.
- ``GraphReplica``: the knowledge graph, the passage vectors that seed it and the batched PPR
  engine; answers HippoRAG 2 graph rankings for batches of query vectors.
- ``RetrievalService``: holds the passages and the query embedder, encodes each batch of queries
  once, fans the vectors out to every shard (merging with the same canonical merge the
  in-process index uses) and to one graph replica (round-robin or least-loaded), and assembles
  ``QueryResult`` objects. It is a ``raggym.retrieval.Retriever`` whose dense index and graph
  ranking are remote, so its results are the in-process ones by construction (and tested).
  It serves up to ``SERVICE_CONCURRENCY`` calls at once (a threaded actor): while one call waits
  for its graph replica or shards, another is encoded and sent to the next replica, so concurrent
  rollout batches overlap across replicas and shards. Its own mutable state (the replica choice,
  the in-flight counts, the call count) is guarded by a lock, and so is query encoding (a fast
  tokenizer must not be entered by two threads at once).

``start_retrieval_service`` creates the actors with declared resources, restarts and retries. The
service is told its shards and replicas by their Ray actor names, not handed their handles: Ray
keeps constructor arguments that hold actor handles in its object store, and a restart fails once
they are evicted (ray-project/ray#53727, logged at error level for every such actor with restarts).
Names are plain strings passed inline, so a restarted service looks its shards up again
(``actors.cluster.resolve_actors``).
"""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from actors.cluster import resolve_actors
from raggym.retrieval import Retriever
from raggym.retrieval.dense import merge_topk, search_shard_canonical

RESTARTS = dict(max_restarts=3, max_task_retries=3)  # a killed actor comes back; its calls are retried
SERVICE_CONCURRENCY = 8  # calls one RetrievalService actor serves at once (threads)


def _set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(int(n))
        try:
            import faiss

            faiss.omp_set_num_threads(int(n))
        except Exception:  # noqa: BLE001 - faiss without OpenMP controls
            pass


class IndexShard:
    """One FAISS shard. Memory: this shard's vectors only."""

    def __init__(self, index_dir: str, shard: int, num_threads: int | None = 1):
        import faiss

        _set_threads(num_threads)
        folder = Path(index_dir) / "dense"
        meta = json.loads((folder / "dense.json").read_text(encoding="utf-8"))
        offsets = np.load(folder / "offsets.npy", allow_pickle=False)
        n_shards = int(meta["config"]["shards"])
        if not 0 <= shard < n_shards:
            raise ValueError(f"{index_dir}: shard {shard} does not exist (the index has {n_shards})")
        self.index = faiss.read_index(str(folder / f"shard-{shard:03d}.faiss"))
        self.offset = int(offsets[shard])
        self.size = int(offsets[shard + 1] - offsets[shard])
        if self.index.ntotal != self.size:
            raise ValueError(f"{index_dir}: shard {shard} holds {self.index.ntotal} vectors, offsets say {self.size}")
        self.shard = shard

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return search_shard_canonical(self.index, np.ascontiguousarray(queries, dtype=np.float32), int(k), self.offset)

    def ping(self) -> int:
        return self.shard


class GraphReplica:
    """Knowledge graph + batched PPR (CUDA when ``device='cuda'`` and a GPU is assigned)."""

    def __init__(self, index_dir: str, device: str = "cpu", num_threads: int | None = 1):
        from dataclasses import replace

        _set_threads(num_threads)
        base = Retriever.load(index_dir, verify=False)
        if base.graph is None:
            raise ValueError(f"{index_dir}: the index has no knowledge graph (build it with OpenIE triples)")
        self.retriever = Retriever(base.corpus, base.passage_vectors, base.dense, base.graph,
                                   embedder_spec=base.embedder_spec, embedder_id=base.embedder_id,
                                   config=replace(base.config, ppr_device=device))
        self.retriever.dense = None  # this actor never searches the dense index
        self.served = 0

    def graph_rank(self, queries: np.ndarray, k: int):
        self.served += len(queries)
        return self.retriever._graph_rank(np.asarray(queries, dtype=np.float32), int(k))

    def ping(self) -> int:
        return self.served


class _ShardFanout:
    """Stands in the place of ``DenseIndex`` inside the service: same ``search``/``cost`` API."""

    def __init__(self, shards: Sequence[Any], ntotal: int, dim: int, config):
        self.shards, self.ntotal, self.dim, self.config = list(shards), int(ntotal), int(dim), config
        self.kind = config.kind

    def search(self, queries: np.ndarray, k: int):
        import ray

        ref = ray.put(np.ascontiguousarray(queries, dtype=np.float32))  # shipped once to all shards
        parts = ray.get([s.search.remote(ref, int(k)) for s in self.shards])
        return merge_topk(parts, int(k))

    def cost(self, queries: np.ndarray) -> np.ndarray:
        if self.kind != "flat":
            raise ValueError("the Ray retrieval service supports exact (flat) shards; ANN cost accounting is in-process only")
        return np.full(len(queries), float(self.ntotal))


class RetrievalService(Retriever):
    """A ``Retriever`` whose dense search and graph ranking run on other actors (``shards`` and
    ``replicas``: handles, or the Ray names of live actors, as ``start_retrieval_service`` gives them)."""

    def __init__(self, index_dir: str, shards: Sequence[Any], replicas: Sequence[Any] = (), routing: str = "round_robin",
                 num_threads: int | None = 1):
        _set_threads(num_threads)
        shards, replicas = resolve_actors(list(shards)), resolve_actors(list(replicas))
        self._state_lock = threading.Lock()  # replica choice, in-flight counts, call count
        self._encode_lock = threading.RLock()  # the embedder (and its lazy load): one thread at a time
        base = Retriever.load(index_dir, verify=False)
        if base.dense.config.shards != len(shards):
            raise ValueError(f"{index_dir}: the index has {base.dense.config.shards} shards but {len(shards)} shard actors were given")
        if routing not in ("round_robin", "least_loaded"):
            raise ValueError(f"routing must be 'round_robin' or 'least_loaded', got {routing!r}")
        fanout = _ShardFanout(shards, base.dense.ntotal, base.dense.dim, base.dense.config)
        super().__init__(base.corpus, base.passage_vectors, fanout, base.graph, embedder_spec=base.embedder_spec,
                         embedder_id=base.embedder_id, config=base.config)
        self.replicas = list(replicas)
        self.routing = routing
        self._rr = itertools.cycle(range(max(1, len(self.replicas))))
        self._in_flight = [0] * len(self.replicas)
        self.calls = 0

    def _pick_replica(self) -> int:
        """Choose a replica and count the call in flight on it (the caller must release it)."""
        with self._state_lock:
            r = int(np.argmin(self._in_flight)) if self.routing == "least_loaded" else next(self._rr)
            self._in_flight[r] += 1
            return r

    def encode_queries(self, texts):
        with self._encode_lock:
            return super().encode_queries(texts)

    @property
    def embedder(self):
        with self._encode_lock:
            return Retriever.embedder.fget(self)

    def _graph_rank(self, q_vecs: np.ndarray, k: int):
        import ray

        if not self.replicas:
            raise ValueError("graph retrieval needs at least one GraphReplica")
        r = self._pick_replica()
        try:
            # Blocks this call's thread only: the actor's other threads serve other calls meanwhile.
            return ray.get(self.replicas[r].graph_rank.remote(q_vecs, int(k)))
        finally:
            with self._state_lock:
                self._in_flight[r] -= 1

    def retrieve(self, queries, mode: str = "passage", k: int = 5):
        with self._state_lock:
            self.calls += 1
        return super().retrieve(queries, mode, k)

    def retrieve_groups(self, groups: Sequence[tuple[str, int, Sequence[str]]]):
        """Several ``(mode, k, queries)`` groups in one call (one per mode used in a rollout wave)."""
        return [self.retrieve(list(queries), mode, int(k)) for mode, k, queries in groups]

    def stats(self) -> dict:
        return {"calls": self.calls, "shards": len(self.dense.shards), "replicas": len(self.replicas)}


def start_retrieval_service(index_dir: str, *, num_replicas: int = 1, replica_per_node: bool = False,
                            routing: str = "round_robin", shard_cpus: float = 0.25, replica_cpus: float = 0.5,
                            replica_gpus: float = 0.0, service_cpus: float = 0.5, name: str | None = None,
                            shard_resources: dict | None = None, replica_class: type = None):
    """Create shard, replica and service actors; returns ``(service, shards, replicas)`` handles.

    The caller keeps all three for as long as it uses the service: the service finds its shards and
    replicas by name, and a handle looked up by name does not keep an actor alive, so Ray ends a
    shard or replica whose creator dropped its handle.

    ``replica_per_node`` places one graph replica on each alive node (ignoring ``num_replicas``).
    ``replica_gpus > 0`` runs PPR on CUDA inside the replica. ``shard_resources`` are custom Ray
    resources every shard requests (to pin shards to labelled nodes). ``replica_class`` is the graph
    replica's class (``GraphReplica`` or a subclass of it).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    meta = json.loads((Path(index_dir) / "dense" / "dense.json").read_text(encoding="utf-8"))
    n_shards = int(meta["config"]["shards"])
    prefix = f"raggym-retrieval-{uuid.uuid4().hex[:12]}"  # the service finds its shards and replicas by name
    Shard = ray.remote(num_cpus=shard_cpus, resources=dict(shard_resources or {}), **RESTARTS)(IndexShard)
    shard_names = [f"{prefix}-shard-{s}" for s in range(n_shards)]
    shards = [Shard.options(name=n).remote(str(index_dir), s) for s, n in enumerate(shard_names)]
    has_graph = json.loads((Path(index_dir) / "manifest.json").read_text(encoding="utf-8")).get("has_graph")
    replicas = []
    if has_graph:
        Replica = ray.remote(num_cpus=replica_cpus, num_gpus=replica_gpus, **RESTARTS)(replica_class or GraphReplica)
        device = "cuda" if replica_gpus > 0 else "cpu"
        if replica_per_node:
            placements = [{"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)}
                          for node in ray.nodes() if node.get("Alive")]
        else:
            placements = [{} for _ in range(num_replicas)]
        replicas = [Replica.options(name=f"{prefix}-replica-{r}", **where).remote(str(index_dir), device)
                    for r, where in enumerate(placements)]
    Service = ray.remote(num_cpus=service_cpus, max_concurrency=SERVICE_CONCURRENCY, **RESTARTS)(RetrievalService)
    opts = {"name": name} if name else {}
    replica_names = [f"{prefix}-replica-{r}" for r in range(len(replicas))]
    service = Service.options(**opts).remote(str(index_dir), shard_names, replica_names, routing)
    return service, shards, replicas


__all__ = ["SERVICE_CONCURRENCY", "GraphReplica", "IndexShard", "RetrievalService", "start_retrieval_service"]
