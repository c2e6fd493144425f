"""The learner's process-level plumbing: the torch.distributed group, collectives, threads, and
how weights load under ZeRO-3.

DeepSpeed and transformers' DeepSpeed integration are imported where used: importing the
learner package (for ``token_logprobs`` or the configs) stays cheap.

CPU notes: fp32, gloo, plain ``torch.optim.AdamW`` (DeepSpeed's CPU Adam needs a compiled op).
DeepSpeed's CPU shared-memory all-reduce op (an inference-only speed-up) costs a ~2 minute C++
build on first use, so it is switched off unless ``cpu_shm_comm=True``.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Mapping

import torch
import torch.distributed as dist

from actors.learner.config import LearnerConfig


def all_reduce(values: torch.Tensor, world_size: int, op=None) -> tuple[torch.Tensor, float]:
    """All-reduce over the data-parallel ranks (sum by default); returns the result and the seconds spent (waiting)."""
    if world_size == 1:
        return values, 0.0
    t0 = time.perf_counter()
    dist.all_reduce(values, op=op or dist.ReduceOp.SUM)
    return values, time.perf_counter() - t0


def ray_cpu_allotment() -> int | None:
    """CPUs Ray assigned to this actor, or None outside a Ray actor.

    Torch's default is one thread per core of the machine; co-located actors (rollout workers,
    retrievers, learners) that each do that oversubscribe the cores and slow each other down.
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    except Exception:  # the driver, not an actor: no allotment
        return None
    return max(1, int(cpus)) if cpus else None


def disable_cpu_shm_comm() -> None:
    # DeepSpeed builds a C++ shared-memory all-reduce op when its comm backend starts on CPU; it
    # only speeds up inference all-reduce, and the first build takes minutes. deepspeed.ops keeps
    # the probed op table in a module-level dict meant to be edited; marking the op incompatible
    # makes DeepSpeed fall back to plain torch.distributed collectives.
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_torch_distributed(rank: int, world_size: int, master_addr: str, master_port: int, backend: str) -> None:
    """Join (or create) the default process group through DeepSpeed's comm layer."""
    import deepspeed

    os.environ.update(
        MASTER_ADDR=str(master_addr), MASTER_PORT=str(master_port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
    )
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"not {rank}/{world_size}"
            )
    deepspeed.init_distributed(
        dist_backend=backend, auto_mpi_discovery=False, distributed_port=int(master_port), verbose=False,
        init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size,
    )


def policy_load_plan(config: LearnerConfig) -> tuple[torch.dtype, bool]:
    """``(dtype, partitioned)``: how a learner loads its policy and reference weights.

    ZeRO-3 loads them partitioned (each rank materialises only its 1/K shard of every weight, in
    the training dtype: bf16 on GPU) through ``zero3_partitioned_loading``; loading full fp32
    copies on every rank first would cost about 12 GB of host RAM per 3B model per rank. The
    other stages keep every weight on every rank anyway: they load fp32 on the host and DeepSpeed
    casts to the training dtype (bf16 on GPU, with fp32 master weights in the optimizer).
    """
    if config.zero_stage == 3:
        return config.resolved_dtype(), True
    return torch.float32, False


@contextmanager
def zero3_partitioned_loading(ds_config: Mapping[str, Any]):
    """Inside, ``from_pretrained`` builds models under ``deepspeed.zero.Init`` (partitioned as created).

    transformers looks the DeepSpeed config up through a weak reference to an ``HfDeepSpeedConfig``
    object, so the object is held for the duration of the block and unregistered afterwards: a
    model loaded later in the same process (another learner, a rollout engine) loads whole.
    """
    if int(ds_config.get("zero_optimization", {}).get("stage", 0)) != 3:
        raise ValueError("partitioned loading is for ZeRO stage 3 configs")
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    registered = HfDeepSpeedConfig(dict(ds_config))  # noqa: F841  (kept alive: transformers holds a weak reference)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


__all__ = ["all_reduce", "disable_cpu_shm_comm", "init_torch_distributed", "policy_load_plan", "ray_cpu_allotment",
           "zero3_partitioned_loading"]
