"""Bounding how stale (off-policy) the samples a trainer learns from may be.

Every model turn of a ``Rollout`` records the weight version that sampled it
(``Rollout.weight_versions``). A rollout's *staleness* at update time is the trainer's current
version minus the oldest version among its turns: 0 when every token came from the weights being
updated (on-policy), ``k`` when some came from weights ``k`` updates old (an engine that had not
been synced yet, or a rollout that overlapped a weight update).

``drop_stale`` keeps only the rollouts within ``max_staleness`` versions (0 = strictly on-policy).
It drops whole groups (``Rollout.group_key``): GRPO-style estimators compare a sample with its
group's other samples, and a group with a member removed would have a different baseline.
"""

from __future__ import annotations

from typing import Sequence

from raggym.trajectory import Rollout


def rollout_staleness(rollout: Rollout, current_version: int) -> int:
    """``current_version`` minus the oldest weight version among the rollout's turns (0 without turns)."""
    versions = rollout.weight_versions
    if not versions:
        return 0
    newest = max(versions)
    if newest > current_version:
        raise ValueError(f"rollout {rollout.group_key} has a turn sampled by weight version {newest}, newer than the "
                         f"trainer's current version {current_version}")
    return int(current_version) - int(min(versions))


def drop_stale(rollouts: Sequence[Rollout], current_version: int, max_staleness: int = 0) -> tuple[list[Rollout], list[Rollout]]:
    """``(kept, dropped)``: whole groups whose every rollout is within ``max_staleness`` versions are kept.

    Order is preserved within both lists.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    stale_groups = {r.group_key for r in rollouts if rollout_staleness(r, current_version) > max_staleness}
    kept = [r for r in rollouts if r.group_key not in stale_groups]
    dropped = [r for r in rollouts if r.group_key in stale_groups]
    return kept, dropped


__all__ = ["drop_stale", "rollout_staleness"]
