"""``LearnerGroup``: K ``Learner`` Ray actors training one policy data-parallel (RLlib's LearnerGroup role).

The group starts the actors, wires their torch.distributed process group (gloo on CPU, NCCL on
GPU), shards each batch across them, averages their metrics and hands the new weights to the
rollout workers. As in RLlib, the Learner computes losses and applies updates; the LearnerGroup
does the distribution; neither knows about environments. Ray is imported where used.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import torch

from actors.cluster import get_all
from actors.learner.batches import shard_batch
from actors.learner.config import LearnerConfig
from actors.learner.learner import Learner
from actors.weight_sync import Loaded, ProbeScores, Published, probe_scores, push_weights_via_object_store
from raggym.algorithms.batch import TrainBatch
from raggym.algorithms.policy_loss import summed_over_ranks


def _mean_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    keys = per_rank[0].keys()
    out = {k: sum(m[k] for m in per_rank) / len(per_rank) for k in keys}
    if "logprob_drift_max" in out:  # the worst token over all ranks; the mean weighted by tokens
        out["logprob_drift_max"] = max(m["logprob_drift_max"] for m in per_rank)
        total = sum(m["logprob_drift_tokens"] for m in per_rank)
        out["logprob_drift_mean"] = (sum(m["logprob_drift_mean"] * m["logprob_drift_tokens"] for m in per_rank) / total
                                     if total else 0.0)
        out["logprob_drift_tokens"] = total
    if "rollout_is/weight_max" in out:  # the rollout correction's largest weight over all ranks
        out["rollout_is/weight_max"] = max(m["rollout_is/weight_max"] for m in per_rank)
    for k in ("tokens", "tokens_computed", "tokens_per_s", *summed_over_ranks()):  # these add up over ranks
        if k in out:
            out[k] = sum(m[k] for m in per_rank)
    out["update_seconds"] = max(m["update_seconds"] for m in per_rank)
    return out


class LearnerGroup:
    """K ``Learner`` Ray actors training one policy data-parallel (RLlib's LearnerGroup role).

    ``resources`` are the Ray options of each learner actor (default ``{"num_cpus": 1}`` on CPU,
    ``{"num_gpus": 1}`` with CUDA). The group's process group uses gloo on CPU, NCCL on GPU.
    Call ``shutdown()`` (or let Ray end) to release the actors.
    """

    def __init__(
        self,
        config: LearnerConfig | Mapping[str, Any] | None = None,
        num_learners: int = 2,
        *,
        resources: Mapping[str, Any] | None = None,
        setup_timeout_s: float = 900.0,
    ):
        import ray

        self.config = LearnerConfig.from_dict(config)
        self.num_learners = int(num_learners)
        if resources is None:
            resources = {"num_gpus": 1} if self.config.resolved_device() == "cuda" else {"num_cpus": 1}
        actor_cls = ray.remote(Learner).options(**resources)
        self.learners = [
            actor_cls.remote(self.config, rank=r, world_size=self.num_learners, setup=False) for r in range(self.num_learners)
        ]
        addr, port = ray.get(self.learners[0].master_endpoint.remote(), timeout=setup_timeout_s)
        self.infos = ray.get([l.setup.remote(addr, port) for l in self.learners], timeout=setup_timeout_s)
        self.version = 0
        self._sync_world = None

    def update(self, batch: TrainBatch, step: int | None = None) -> dict[str, float]:
        """Shard the batch over the learners, update, and return rank-averaged metrics."""
        # get_all: a dead or OOM-killed rank raises now, not at NCCL's timeout
        shards = shard_batch(batch, self.num_learners)
        per_rank = get_all([l.update.remote(s, step) for l, s in zip(self.learners, shards)], what="learner update")
        self.version += 1
        metrics = _mean_metrics(per_rank)
        metrics["weight_version"] = float(self.version)
        return metrics

    def compute_logprobs(self, token_ids, attention_mask=None) -> torch.Tensor:
        """Current-policy logprobs, computed on rank 0 (ZeRO-3 needs every rank: use update's own)."""
        import ray

        if self.config.zero_stage == 3:
            n = len(token_ids)
            ids = torch.as_tensor(token_ids)
            attn = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
            if n % self.num_learners:
                raise ValueError("under ZeRO-3 compute_logprobs needs a batch that splits evenly over the learners")
            per = n // self.num_learners
            parts = ray.get([
                l.compute_logprobs.remote(ids[r * per : (r + 1) * per], attn[r * per : (r + 1) * per])
                for r, l in enumerate(self.learners)
            ])
            return torch.cat(parts)
        return ray.get(self.learners[0].compute_logprobs.remote(token_ids, attention_mask))

    def score_probe_async(self, token_ids) -> list:
        """Refs of the learners' ``score_probe`` (rank 0's is the group's, the first ref): every rank
        under ZeRO-3, whose forward needs them all, else rank 0 alone."""
        ranks = self.learners if self.config.zero_stage == 3 else self.learners[:1]
        return [l.score_probe.remote(list(token_ids)) for l in ranks]

    def publish_weights(self, dtype: torch.dtype | str | None = None, probe: Sequence[int] | None = None) -> Published:
        """Put the current weights into the object store once; returns rank 0's ``Published``
        (the ``ObjectRef`` and, with ``probe``, the learner's scores of it)."""
        import ray

        return ray.get([l.publish_weights.remote(dtype, probe) for l in self.learners])[0]

    def sync_weights(self, workers: Sequence, dtype: torch.dtype | str | None = None,
                     probe: Sequence[int] | None = None) -> tuple[dict[str, float], ProbeScores | None]:
        """Object-store sync: publish once, every worker loads it. Returns versions and seconds, and
        with ``probe`` the learner's and each worker's scores of it under the synced weights."""
        t0 = time.perf_counter()
        published = self.publish_weights(dtype, probe)
        t1 = time.perf_counter()
        loaded = push_weights_via_object_store(published.weights, workers, probe=probe)
        t2 = time.perf_counter()
        self._check_versions(loaded)
        metrics = {"weight_version": float(self.version), "publish_seconds": t1 - t0, "load_seconds": t2 - t1,
                   "sync_seconds": t2 - t0}
        return metrics, None if probe is None else probe_scores(published, loaded)

    def _check_versions(self, loaded: Sequence[Loaded]) -> None:
        versions = [w.version for w in loaded]
        if set(versions) != {self.version}:
            raise RuntimeError(f"rollout workers report weight versions {versions}, expected {self.version}")

    def resync_restarted(self, workers: Sequence, timeout_s: float = 600.0) -> list[int]:
        """Load the current weights into every worker that Ray restarted and that has not been synced
        since (``RolloutWorker(require_sync="after_restart")`` refuses to generate until then);
        returns their indices. The object store carries them whatever the sync mode: a restarted
        worker has lost its place in any collective group, so that group is dropped here and must be
        rebuilt with ``init_weight_sync`` before the next ``broadcast_weights``."""
        import ray

        infos = ray.get([w.info.remote() for w in workers], timeout=timeout_s)
        stale = [i for i, info in enumerate(infos) if not info["synced"]]
        if stale:
            self.sync_weights([workers[i] for i in stale])
            self._sync_world = None
        return stale

    def init_weight_sync(self, workers: Sequence, backend: str = "gloo", timeout_s: float = 600.0) -> int:
        """Build a ``WeightSyncGroup`` of learner rank 0 and every worker's engine rank(s)."""
        import ray

        ranks = ray.get([w.sync_ranks.remote() for w in workers], timeout=timeout_s)
        world = 1 + sum(ranks)
        addr, port = ray.get(self.learners[0].master_endpoint.remote(), timeout=timeout_s)
        calls = [self.learners[0].init_weight_sync.remote(addr, port, world, backend)]
        offset = 1
        for w, r in zip(workers, ranks):
            calls.append(w.init_weight_sync_async.remote(addr, port, offset, world, backend))
            offset += r
        ray.get(calls, timeout=timeout_s)
        self._sync_world = world
        return world

    def broadcast_weights(self, workers: Sequence, dtype: torch.dtype | str | None = None, timeout_s: float = 600.0,
                          probe: Sequence[int] | None = None) -> tuple[dict[str, float], ProbeScores | None]:
        """Collective sync over the group built by ``init_weight_sync``; returns what
        ``sync_weights`` does."""
        import ray

        if self._sync_world is None:
            raise RuntimeError("call init_weight_sync(workers, backend) first (again after resync_restarted found a restarted worker)")
        t0 = time.perf_counter()
        receives = [w.receive_weights_async.remote(probe) for w in workers]
        sends = [l.broadcast_weights.remote(dtype, probe) for l in self.learners]
        loaded = ray.get(receives, timeout=timeout_s)
        published = ray.get(sends, timeout=timeout_s)[0]
        self._check_versions(loaded)
        metrics = {"weight_version": float(self.version), "bytes": float(published.bytes_sent),
                   "sync_seconds": time.perf_counter() - t0}
        return metrics, None if probe is None else probe_scores(published, loaded)

    def save_checkpoint(self, out_dir: str, policy: bool = True) -> str:
        """Every learner takes part (ZeRO-3 gathers); rank 0 writes ``learner/`` and ``policy/``."""
        return self.call("save_checkpoint", out_dir, policy)[0]

    def load_checkpoint(self, in_dir: str) -> dict:
        """Restore all learners (any ZeRO stage or learner count can read any checkpoint)."""
        meta = self.call("load_checkpoint", in_dir)[0]
        self.version = int(meta["version"])
        return meta

    def call(self, method: str, *args, **kwargs) -> list:
        """Run a ``Learner`` method on every learner and return the results (rank order)."""
        return get_all([getattr(l, method).remote(*args, **kwargs) for l in self.learners], what=f"learner {method}")

    def shutdown(self) -> None:
        import ray

        for learner in self.learners:
            ray.kill(learner)
        self.learners = []


__all__ = ["LearnerGroup"]
