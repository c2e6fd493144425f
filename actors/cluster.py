"""The one policy for starting Ray (training, evaluation, the demo, the benchmarks).

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


__all__ = ["init_ray"]
