"""Advantage estimators: GRPO (and Dr.GRPO), Step-GRPO, PathRouter's route-conditioned scaling,
broadcasting to tokens, and DAPO's dynamic-sampling filter.

All functions are pure: tensors (or plain id sequences) in, tensors out. Sequence-level tensors
are ``[batch]``; token-level tensors are ``[batch, seq]`` with a 0/1 response (loss) mask.

GRPO (Shao et al., 2024, DeepSeekMath §4.1.2, outcome supervision)::

    Â_i = (r_i − mean_{j ∈ g(i)} r_j) / (std_{j ∈ g(i)} r_j + ε)

where ``g(i)`` is the group of rollouts that share ``i``'s prompt id. A group whose rewards are
all equal (including a group of one) carries no preference and gets advantage exactly 0.

Groups of one differ between implementations: verl's ``compute_grpo_outcome_advantage`` gives a
singleton group mean 0 and std 1, so its advantage is ``r_i / (1 + ε)`` (``r_i`` without the std
division), a raw reward with no baseline. raggym's default (``singleton_group="zero"``) gives it
advantage 0, since a group of one compares the rollout with nothing; ``singleton_group="verl"``
reproduces verl. Equal-reward groups of two or more get 0 under both rules.

* ``normalize_by_std=False`` is Dr.GRPO (Liu et al., 2025, "Understanding R1-Zero-Like
  Training: A Critical Perspective", arXiv:2503.20783): ``Â_i = r_i − mean_g r``; dividing by
  the group std over-weights prompts that are nearly always solved or nearly always failed.
* ``unbiased_std=True`` (the default) uses the sample std (divide by n − 1), as verl and TRL do;
  ``False`` uses the population std (divide by n).

Batch-level rewards that must be computed *before* group normalisation — RouteRAG's
batch-centred efficiency term — are batch transforms over episode records in
``raggym.rewards.routerag.routerag_batch_rewards``; feed their output here.

Step-GRPO (R1-Router, Peng et al., 2025, arXiv:2505.22095, Step-GRPO section): each reasoning
step is its own group, keyed by ``(prompt id, step index)``.

Route-conditioned advantage (PathRouter, Wang et al., 2026, arXiv:2606.16409, path-aware
advantage scaling)::

    C = [EM > 0 or F1 ≥ 0.5],   P = [EO ≥ θ_P] (θ_P = 0.1)
    Ã_i = w_{route(C_i, P_i)} · Â_i,   w = (C↑P↑ 1.0, C↑P↓ 0.5, C↓P↑ 0.3, C↓P↓ 1.0)

Correct-but-unsupported answers (shortcuts) are damped, and wrong answers that did find
evidence are punished less.

Dynamic sampling (DAPO, Yu et al., 2025, arXiv:2503.14476, §3.2): drop groups whose rewards
are all equal, since they contribute zero advantage and only dilute the token-mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Hashable, Literal, Sequence

import torch

GroupIds = Sequence[Hashable] | torch.Tensor
SingletonGroupRule = Literal["zero", "verl"]
SINGLETON_GROUP_RULES: tuple[str, ...] = ("zero", "verl")


class Route(IntEnum):
    """PathRouter's four trajectory routes (correctness × evidence)."""

    CORRECT_SUPPORTED = 0  # C↑P↑
    CORRECT_UNSUPPORTED = 1  # C↑P↓ — a shortcut: right answer without the evidence path
    INCORRECT_SUPPORTED = 2  # C↓P↑ — found evidence, failed to use it
    INCORRECT_UNSUPPORTED = 3  # C↓P↓


# Indexed by Route value.
PATHROUTER_ROUTE_WEIGHTS: tuple[float, float, float, float] = (1.0, 0.5, 0.3, 1.0)


def group_index(group_ids: GroupIds) -> tuple[torch.Tensor, int]:
    """Map group keys to dense indices ``0..n_groups-1``.

    Sequences of hashable keys are numbered in first-seen order; a tensor of keys in sorted
    order (``torch.unique``).

    Returns ``(index [batch] long, n_groups)``.
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D, got shape {tuple(group_ids.shape)}")
        _, index = torch.unique(group_ids, return_inverse=True)
        return index.long(), int(index.max().item()) + 1 if index.numel() else 0
    dense: dict[Hashable, int] = {}
    index_list = [dense.setdefault(key, len(dense)) for key in group_ids]
    return torch.tensor(index_list, dtype=torch.long), len(dense)


def _check_rewards(rewards: torch.Tensor, n: int) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [batch], got shape {tuple(rewards.shape)}")
    if rewards.shape[0] != n:
        raise ValueError(f"{rewards.shape[0]} rewards but {n} group ids")


def _group_stats(rewards: torch.Tensor, index: torch.Tensor, n_groups: int, unbiased: bool):
    """Per-sample group mean, std, an 'all rewards equal' flag and the group size, in float64."""
    r = rewards.to(torch.float64)
    index = index.to(r.device)
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(
        0, index, torch.ones_like(r)
    )
    total = torch.zeros_like(count).index_add_(0, index, r)
    mean = total / count
    sq_dev = torch.zeros_like(count).index_add_(0, index, (r - mean[index]) ** 2)
    denom = (count - 1).clamp(min=1) if unbiased else count
    std = (sq_dev / denom).sqrt()
    g_max = torch.full_like(count, -torch.inf).scatter_reduce(0, index, r, reduce="amax")
    g_min = torch.full_like(count, torch.inf).scatter_reduce(0, index, r, reduce="amin")
    uniform = g_max == g_min
    return mean[index], std[index], uniform[index], count[index]


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: GroupIds,
    *,
    eps: float = 1e-6,
    normalize_by_std: bool = True,
    unbiased_std: bool = True,
    singleton_group: SingletonGroupRule = "zero",
) -> torch.Tensor:
    """Group-relative advantages ``[batch]`` from scalar rewards ``[batch]``.

    ``group_ids`` holds one key per rollout (the prompt id). See the module docstring for the
    Dr.GRPO and std options and for ``singleton_group`` (``"zero"`` or verl's ``"verl"``).
    """
    if singleton_group not in SINGLETON_GROUP_RULES:
        raise ValueError(f"singleton_group must be one of {', '.join(SINGLETON_GROUP_RULES)}, got {singleton_group!r}")
    index, n_groups = group_index(group_ids)
    _check_rewards(rewards, index.shape[0])
    if rewards.shape[0] == 0:
        return rewards.clone().float()
    mean, std, uniform, count = _group_stats(rewards, index, n_groups, unbiased_std)
    if singleton_group == "verl":
        single = count == 1
        mean = torch.where(single, torch.zeros_like(mean), mean)  # verl: a group of one has mean 0 …
        std = torch.where(single, torch.ones_like(std), std)  # … and std 1
        uniform = uniform & ~single
    centred = rewards.to(torch.float64) - mean  # r_i − mean_g(r)
    if normalize_by_std:
        advantages = centred / (std + eps)  # (r_i − mean_g r) / (std_g r + ε)
    else:
        advantages = centred  # Dr.GRPO: no std division
    advantages = torch.where(uniform, torch.zeros_like(advantages), advantages)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return advantages.to(out_dtype)


def step_grpo_advantages(
    rewards: torch.Tensor,
    prompt_ids: Sequence[Hashable],
    step_indices: Sequence[int] | torch.Tensor,
    **grpo_kwargs,
) -> torch.Tensor:
    """Step-GRPO: GRPO with one group per ``(prompt id, step index)``.

    ``rewards[i]`` is the reward of step record ``i`` (a router step or an answer step).
    """
    steps = step_indices.tolist() if isinstance(step_indices, torch.Tensor) else list(step_indices)
    if len(steps) != len(prompt_ids):
        raise ValueError(f"{len(prompt_ids)} prompt ids but {len(steps)} step indices")
    keys = list(zip(prompt_ids, steps))
    return grpo_advantages(rewards, keys, **grpo_kwargs)


def route_from_flags(correct: torch.Tensor, evidence_supported: torch.Tensor) -> torch.Tensor:
    """Route id per trajectory (see ``Route``) from boolean C and P tensors ``[batch]``."""
    c = correct.to(torch.bool)
    p = evidence_supported.to(torch.bool)
    return (2 * (~c).long() + (~p).long())  # C↑P↑=0, C↑P↓=1, C↓P↑=2, C↓P↓=3


def route_conditioned_advantages(
    rewards: torch.Tensor,
    group_ids: GroupIds,
    correct: torch.Tensor,
    evidence_supported: torch.Tensor,
    route_weights: Sequence[float] = PATHROUTER_ROUTE_WEIGHTS,
    **grpo_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PathRouter: ``Ã = w_route · Â`` with ``Â`` the GRPO advantage.

    Returns ``(advantages [batch], routes [batch] long)``; the routes are for logging.
    ``route_weights`` is indexed by ``Route`` value.
    """
    if len(route_weights) != len(Route):
        raise ValueError(f"route_weights needs {len(Route)} entries, got {len(route_weights)}")
    base = grpo_advantages(rewards, group_ids, **grpo_kwargs)  # Â
    routes = route_from_flags(correct, evidence_supported).to(base.device)
    weights = torch.tensor(list(route_weights), dtype=base.dtype, device=base.device)
    return weights[routes] * base, routes  # Ã = w_route · Â


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sequence advantages ``[batch]`` → token advantages ``[batch, seq]``, zero where masked."""
    if advantages.dim() != 1 or response_mask.dim() != 2:
        raise ValueError(
            f"expected advantages [batch] and mask [batch, seq], got {tuple(advantages.shape)} "
            f"and {tuple(response_mask.shape)}"
        )
    if advantages.shape[0] != response_mask.shape[0]:
        raise ValueError("advantages and mask disagree on the batch size")
    return advantages.unsqueeze(-1) * response_mask.to(advantages.dtype)  # A_{i,t} = A_i · m_{i,t}


@dataclass(frozen=True)
class DynamicSamplingResult:
    """Outcome of ``dynamic_sampling_filter``.

    ``keep`` is a ``[batch]`` bool mask over rollouts; the counts are over groups and samples.
    """

    keep: torch.Tensor
    kept_groups: int
    dropped_groups: int
    dropped_samples: int


def dynamic_sampling_filter(rewards: torch.Tensor, group_ids: GroupIds) -> DynamicSamplingResult:
    """DAPO dynamic sampling: keep only groups whose rewards are not all equal."""
    index, n_groups = group_index(group_ids)
    _check_rewards(rewards, index.shape[0])
    if rewards.shape[0] == 0:
        return DynamicSamplingResult(torch.zeros(0, dtype=torch.bool), 0, 0, 0)
    _, _, uniform, _ = _group_stats(rewards, index, n_groups, unbiased=True)
    keep = ~uniform
    dropped_groups = int(torch.unique(index[uniform]).numel())
    return DynamicSamplingResult(
        keep=keep,
        kept_groups=n_groups - dropped_groups,
        dropped_groups=dropped_groups,
        dropped_samples=int(uniform.sum().item()),
    )


# ----------------------------------------------------------------------------- registry
#
# The trainer picks an estimator by name (``advantage.estimator`` in a config). Every estimator
# takes the batch's scalar rewards, one group key per rollout — ``(prompt id, step index)``; the
# step index is 0 except for Step-GRPO's teacher-forced steps — and the episode outcomes, plus
# the options of the config's ``advantage`` section, and returns an ``AdvantageOutput``. A new
# estimator is one decorated function:
#
#     @register_advantage_estimator("my_estimator")
#     def my_estimator(rewards, group_keys, outcomes, **options) -> AdvantageOutput: ...


@dataclass(frozen=True)
class AdvantageOutput:
    """Sequence advantages ``[batch]`` and, for route-conditioned estimators, each route."""

    advantages: torch.Tensor
    routes: torch.Tensor | None = None


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., AdvantageOutput]] = {}
_GRPO_OPTIONS = ("eps", "normalize_by_std", "unbiased_std", "singleton_group")


def register_advantage_estimator(name: str, *, replace: bool = False):
    """Decorator: make ``fn(rewards, group_keys, outcomes, **options)`` usable as ``name``."""

    def decorate(fn: Callable[..., AdvantageOutput]) -> Callable[..., AdvantageOutput]:
        if name in ADVANTAGE_ESTIMATORS and not replace:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorate


def get_advantage_estimator(name: str) -> Callable[..., AdvantageOutput]:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


def _grpo_options(options) -> dict:
    return {k: options[k] for k in _GRPO_OPTIONS if k in options}


@register_advantage_estimator("grpo")
def grpo_estimator(rewards: torch.Tensor, group_keys: Sequence[Hashable], outcomes=(), **options) -> AdvantageOutput:
    """GRPO / Dr.GRPO over groups of identical group keys."""
    return AdvantageOutput(grpo_advantages(rewards, list(group_keys), **_grpo_options(options)))


@register_advantage_estimator("step_grpo")
def step_grpo_estimator(rewards: torch.Tensor, group_keys: Sequence[Hashable], outcomes=(), **options) -> AdvantageOutput:
    """Step-GRPO: the group key already is ``(prompt id, step index)``; one group per step."""
    keys = list(group_keys)
    if any(not (isinstance(k, tuple) and len(k) == 2) for k in keys):
        raise ValueError("step_grpo needs (prompt id, step index) group keys")
    return AdvantageOutput(step_grpo_advantages(rewards, [k[0] for k in keys], [k[1] for k in keys],
                                                **_grpo_options(options)))


@register_advantage_estimator("route")
def route_estimator(rewards: torch.Tensor, group_keys: Sequence[Hashable], outcomes=(), *,
                    route_weights: Sequence[float] = PATHROUTER_ROUTE_WEIGHTS, correct_f1_threshold: float = 0.5,
                    evidence_threshold: float = 0.1, **options) -> AdvantageOutput:
    """PathRouter: GRPO scaled by the weight of each trajectory's (C, P) route.

    C and P come from the outcomes' own metrics (``EpisodeOutcome.em``/``f1``/``evidence_overlap``),
    with the reward's thresholds, so the route and the reward never disagree.
    """
    if len(outcomes) != len(rewards):
        raise ValueError(f"route advantages need one outcome per reward ({len(outcomes)} vs {len(rewards)})")
    correct = torch.tensor([o.em > 0 or o.f1 >= correct_f1_threshold for o in outcomes], dtype=torch.bool)
    supported = torch.tensor([o.evidence_overlap >= evidence_threshold for o in outcomes], dtype=torch.bool)
    advantages, routes = route_conditioned_advantages(rewards, list(group_keys), correct, supported,
                                                      tuple(route_weights), **_grpo_options(options))
    return AdvantageOutput(advantages, routes)
