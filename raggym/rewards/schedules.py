"""Stage and phase schedules: a training step → the batch reward function in force at that step.

Three methods change their reward during training:

* RouteRAG — stage 1 (EM) until ``stage2_start``, then stage 2 (EM + batch-centred efficiency).
* LWS — stage 1 until ``stage2_start``, then stage 2 (the answer term flips its β·RC sign).
* GraphRAG-R1 — phase 1 is the SFT cold start (``sft_steps`` steps, no reward), phase 2 is
  format + PRA until ``phase3_start``, then phase 3 is format + CAF.

PathRouter and the Search-R1 baseline (EM) have one stage; they are included so that every
episode-level recipe can be driven the same way. R1-Router scores teacher-forced steps: each of
its rollouts is one step whose outcome holds that step's record
(``raggym.rewards.r1_router.r1_router_step_rewards``), so it is driven the same way too.

Every reward function has the batch signature ``(outcomes) -> list[float]``, because RouteRAG's
stage 2 needs the whole batch. Steps count from 0; a stage that starts at step ``s`` is in force
for every step ``≥ s``.

``reward_schedule_from_config`` builds a schedule from a plain mapping (e.g. an OmegaConf node
converted with ``OmegaConf.to_container``)::

    {"method": "routerag", "stage2_start": 20, "time_source": "cost"}
    {"method": "lws", "stage2_start": 50, "beta": 0.3}
    {"method": "graphrag_r1", "sft_steps": 0, "phase3_start": 100, "pra_decay": 0.5}

Unknown keys raise ``ValueError`` naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from raggym.rewards.graphrag_r1 import GraphRAGR1Config, graphrag_r1_batch_rewards
from raggym.rewards.lws import Embedder, Judge, LWSConfig, lws_batch_rewards
from raggym.rewards.metrics import exact_match
from raggym.rewards.outcome import EpisodeOutcome
from raggym.rewards.pathrouter import PathRouterConfig, pathrouter_batch_rewards
from raggym.rewards.r1_router import r1_router_step_rewards
from raggym.rewards.routerag import RouteRAGConfig, routerag_batch_rewards

BatchReward = Callable[[Sequence[EpisodeOutcome]], list[float]]


@dataclass(frozen=True)
class StageSchedule:
    """Piecewise-constant stages: ``stages[i]`` holds from step ``starts[i]``; ``starts[0] == 0``."""

    stages: tuple[str, ...]
    starts: tuple[int, ...]

    def __post_init__(self):
        if len(self.stages) != len(self.starts) or not self.stages:
            raise ValueError("need one start step per stage, and at least one stage")
        if self.starts[0] != 0:
            raise ValueError("the first stage must start at step 0")
        if any(b < a for a, b in zip(self.starts, self.starts[1:])):
            raise ValueError(f"stage starts must be non-decreasing, got {self.starts}")

    def stage_at(self, step: int) -> str:
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        current = self.stages[0]
        for name, start in zip(self.stages, self.starts):
            if step >= start:
                current = name
        return current


class RewardSchedule:
    """Maps a training step to its stage name and batch reward function."""

    def __init__(
        self, method: str, schedule: StageSchedule, rewards: Mapping[str, BatchReward | None]
    ):
        missing = set(schedule.stages) - set(rewards)
        if missing:
            raise ValueError(f"no reward function for stage(s) {sorted(missing)}")
        self.method = method
        self.schedule = schedule
        self._rewards = dict(rewards)

    def stage_at(self, step: int) -> str:
        return self.schedule.stage_at(step)

    def reward_fn(self, step: int) -> BatchReward:
        stage = self.stage_at(step)
        fn = self._rewards[stage]
        if fn is None:
            raise ValueError(
                f"{self.method}: step {step} is in stage {stage!r}, which is supervised and has "
                "no reward"
            )
        return fn

    def __call__(self, step: int) -> BatchReward:
        return self.reward_fn(step)

    def __repr__(self) -> str:
        parts = ", ".join(f"{s}@{b}" for s, b in zip(self.schedule.stages, self.schedule.starts))
        return f"RewardSchedule({self.method}: {parts})"


def routerag_schedule(
    stage2_start: int = 20, config: RouteRAGConfig = RouteRAGConfig()
) -> RewardSchedule:
    return RewardSchedule(
        "routerag",
        StageSchedule(("stage1", "stage2"), (0, stage2_start)),
        {
            "stage1": lambda outcomes: routerag_batch_rewards(outcomes, 1, config),
            "stage2": lambda outcomes: routerag_batch_rewards(outcomes, 2, config),
        },
    )


def lws_schedule(
    stage2_start: int,
    config: LWSConfig = LWSConfig(),
    embed: Embedder | None = None,
    judge: Judge | None = None,
) -> RewardSchedule:
    """``embed`` maps query strings to embeddings; needed as soon as an episode searches twice.
    ``judge(question, answer, golds) -> bool`` decides correctness (default: EM or F1 ≥ 0.5)."""

    def stage(n: int) -> BatchReward:
        return lambda outcomes: lws_batch_rewards(outcomes, n, config, embed=embed, judge=judge)

    return RewardSchedule(
        "lws",
        StageSchedule(("stage1", "stage2"), (0, stage2_start)),
        {"stage1": stage(1), "stage2": stage(2)},
    )


def graphrag_r1_schedule(
    phase3_start: int, sft_steps: int = 0, config: GraphRAGR1Config = GraphRAGR1Config()
) -> RewardSchedule:
    """Phase 1 (SFT) for ``sft_steps`` steps, phase 2 until ``phase3_start``, then phase 3."""
    if phase3_start < sft_steps:
        raise ValueError("phase3_start must not come before the end of the SFT phase")
    stages, starts = ("phase2", "phase3"), (0, phase3_start)
    if sft_steps > 0:
        stages, starts = ("phase1_sft",) + stages, (0, sft_steps, phase3_start)
    return RewardSchedule(
        "graphrag_r1",
        StageSchedule(stages, starts),
        {
            "phase1_sft": None,
            "phase2": lambda outcomes: graphrag_r1_batch_rewards(outcomes, 2, config),
            "phase3": lambda outcomes: graphrag_r1_batch_rewards(outcomes, 3, config),
        },
    )


def pathrouter_schedule(config: PathRouterConfig = PathRouterConfig()) -> RewardSchedule:
    return RewardSchedule(
        "pathrouter",
        StageSchedule(("main",), (0,)),
        {"main": lambda outcomes: pathrouter_batch_rewards(outcomes, config)},
    )


def exact_match_schedule() -> RewardSchedule:
    """Single-stage EM reward (the Search-R1 baseline)."""
    return RewardSchedule(
        "search_r1",
        StageSchedule(("main",), (0,)),
        {"main": lambda outcomes: [exact_match(o.answer, o.gold_answers) for o in outcomes]},
    )


def r1_router_schedule(embed: Embedder) -> RewardSchedule:
    """R1-Router: one stage; each rollout is one teacher-forced step scored by its step reward."""
    return RewardSchedule("r1_router", StageSchedule(("main",), (0,)),
                          {"main": lambda outcomes: r1_router_step_rewards(outcomes, embed)})


def _split_config(method: str, cfg: Mapping[str, Any], schedule_keys: set[str], config_cls):
    config_keys = {f.name for f in dataclasses.fields(config_cls)} if config_cls else set()
    unknown = sorted(set(cfg) - schedule_keys - config_keys - {"method"})
    if unknown:
        allowed = ", ".join(sorted(schedule_keys | config_keys))
        raise ValueError(f"{method} reward config: unknown key(s) {unknown}; allowed: {allowed}")
    kwargs = {}
    for k in config_keys & set(cfg):
        value = cfg[k]
        if isinstance(value, list):
            value = tuple(value)
        kwargs[k] = value
    config = config_cls(**kwargs) if config_cls else None
    return config, {k: cfg[k] for k in schedule_keys & set(cfg)}


def reward_schedule_from_config(
    cfg: Mapping[str, Any], embed: Embedder | None = None, judge: Judge | None = None
) -> RewardSchedule:
    """Build a ``RewardSchedule`` from a plain mapping (see the module docstring)."""
    method = cfg.get("method")
    if method == "routerag":
        config, sched = _split_config(method, cfg, {"stage2_start"}, RouteRAGConfig)
        return routerag_schedule(int(sched.get("stage2_start", 20)), config)
    if method == "lws":
        config, sched = _split_config(method, cfg, {"stage2_start"}, LWSConfig)
        if "stage2_start" not in sched:
            raise ValueError("lws reward config: 'stage2_start' is required")
        return lws_schedule(int(sched["stage2_start"]), config, embed=embed, judge=judge)
    if method == "graphrag_r1":
        config, sched = _split_config(method, cfg, {"phase3_start", "sft_steps"}, GraphRAGR1Config)
        if "phase3_start" not in sched:
            raise ValueError("graphrag_r1 reward config: 'phase3_start' is required")
        return graphrag_r1_schedule(
            int(sched["phase3_start"]), int(sched.get("sft_steps", 0)), config
        )
    if method == "pathrouter":
        config, _ = _split_config(method, cfg, set(), PathRouterConfig)
        return pathrouter_schedule(config)
    if method == "search_r1":
        _split_config(method, cfg, set(), None)
        return exact_match_schedule()
    if method == "r1_router":
        _split_config(method, cfg, {"embedder"}, None)  # the embedder spec is resolved by the caller
        if embed is None:
            raise ValueError("r1_router reward: needs an embedder (sub-question similarity)")
        return r1_router_schedule(embed)
    if method in CUSTOM_SCHEDULES:
        return CUSTOM_SCHEDULES[method]({k: v for k, v in cfg.items() if k != "method"})
    raise ValueError(
        f"unknown reward method {method!r}; expected one of routerag, lws, graphrag_r1, "
        f"pathrouter, search_r1, r1_router{''.join(', ' + m for m in CUSTOM_SCHEDULES)}"
    )


BUILTIN_METHODS = ("routerag", "lws", "graphrag_r1", "pathrouter", "search_r1", "r1_router")
# method name -> builder(options without "method") -> RewardSchedule; see register_reward_schedule
CUSTOM_SCHEDULES: dict[str, Callable[[dict], RewardSchedule]] = {}


def register_reward_schedule(method: str, builder: Callable[[dict], RewardSchedule], *, replace: bool = False) -> None:
    """Let ``reward_schedule_from_config({"method": method, ...})`` build a new reward.

    ``builder`` receives the remaining config keys as a dict and returns a ``RewardSchedule``; it
    should reject keys it does not know. Built-in method names cannot be taken."""
    if not isinstance(method, str) or not method:
        raise ValueError("the reward method name must be a non-empty string")
    if method in BUILTIN_METHODS or (method in CUSTOM_SCHEDULES and not replace):
        raise ValueError(f"reward method {method!r} is already registered")
    if not callable(builder):
        raise TypeError(f"builder for {method!r} must be callable")
    CUSTOM_SCHEDULES[method] = builder
