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
    {"method": "graphrag_r1", "phase3_start": 100, "pra_decay": 0.5}

``method`` picks the reward; the other keys are the fields of its section dataclass
(``REWARD_SECTIONS``: the schedule's own keys and the reward's config). The training config checks
its ``reward:`` section against that dataclass (``experiments.recipe.config``); here an unknown or
missing required key raises ``ValueError`` naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from raggym.config_util import dataclass_from_mapping
from raggym.judge import JudgeConfig
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


# ----------------------------------------------------------------------------- config sections
# The ``reward:`` keys of each method, less ``method`` itself. A section is (a subclass of) the
# reward's config, so the built section is the config its reward functions read.


@dataclass(frozen=True)
class RouteRAGSection(RouteRAGConfig):
    stage2_start: int = 20


@dataclass(frozen=True, kw_only=True)
class LWSSection(LWSConfig):
    stage2_start: int
    embedder: str = "minilm"  # the query embedder's spec; the trainer turns it into ``embed``
    judge: JudgeConfig | None = None  # an LLM judge the trainer builds (None: ``correct_if``)


@dataclass(frozen=True, kw_only=True)
class GraphRAGR1Section(GraphRAGR1Config):
    # no sft_steps: phase 1, the SFT cold start, is the trainer's sft: section
    phase3_start: int


@dataclass(frozen=True)
class R1RouterSection:
    embedder: str = "minilm"  # the sub-question embedder's spec; the trainer turns it into ``embed``


@dataclass(frozen=True)
class SearchR1Section:
    """Exact match has no settings."""


# method -> its section dataclass; register_reward_schedule adds custom methods that have one
REWARD_SECTIONS: dict[str, type] = {
    "routerag": RouteRAGSection, "lws": LWSSection, "graphrag_r1": GraphRAGR1Section,
    "pathrouter": PathRouterConfig, "search_r1": SearchR1Section, "r1_router": R1RouterSection}
BUILTIN_METHODS = tuple(REWARD_SECTIONS)
# method name -> builder(its section, or its options without "method") -> RewardSchedule
CUSTOM_SCHEDULES: dict[str, Callable[[Any], RewardSchedule]] = {}


def reward_methods() -> list[str]:
    """Every method ``reward_schedule_from_config`` can build: the built-in and the registered ones."""
    return sorted({*BUILTIN_METHODS, *CUSTOM_SCHEDULES})


def reward_section(method: str) -> type | None:
    """The section dataclass of ``method``'s keys; None for an unknown method, or one registered
    without a section (its builder checks its keys)."""
    return REWARD_SECTIONS.get(method) if method in reward_methods() else None


def reward_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A ``reward:`` config's keys for its method's section: all but ``method``, which picks it."""
    return {k: v for k, v in cfg.items() if k != "method"}


def reward_schedule_from_config(
    cfg: Mapping[str, Any], embed: Embedder | None = None, judge: Judge | None = None
) -> RewardSchedule:
    """Build a ``RewardSchedule`` from a plain mapping (see the module docstring)."""
    method = cfg.get("method")
    if method not in reward_methods():
        raise ValueError(f"unknown reward method {method!r}; expected one of {', '.join(reward_methods())}")
    options = reward_options(cfg)
    section = reward_section(method)
    settings = dataclass_from_mapping(section, options, f"{method} reward") if section else options
    if method in CUSTOM_SCHEDULES:
        return CUSTOM_SCHEDULES[method](settings)
    return _builtin_schedule(method, settings, embed, judge)


def _builtin_schedule(method: str, section, embed: Embedder | None, judge: Judge | None) -> RewardSchedule:
    if method == "routerag":
        return routerag_schedule(section.stage2_start, section)
    if method == "lws":
        return lws_schedule(section.stage2_start, section, embed=embed, judge=judge)
    if method == "graphrag_r1":
        return graphrag_r1_schedule(section.phase3_start, config=section)
    if method == "pathrouter":
        return pathrouter_schedule(section)
    if method == "search_r1":
        return exact_match_schedule()
    if embed is None:  # r1_router
        raise ValueError("r1_router reward: needs an embedder (sub-question similarity)")
    return r1_router_schedule(embed)


def register_reward_schedule(method: str, builder: Callable[[Any], RewardSchedule], *,
                             section: type | None = None, replace: bool = False) -> None:
    """Let ``reward_schedule_from_config({"method": method, ...})`` build a new reward.

    ``section``, a dataclass of the method's keys, makes the training config check them when it
    loads (unknown keys, types) like every other section's, and ``builder`` receives an instance
    of it. Without one, ``builder`` receives the remaining config keys as a dict and should reject
    keys it does not know. Either way it returns a ``RewardSchedule``. Built-in method names
    cannot be taken."""
    if not isinstance(method, str) or not method:
        raise ValueError("the reward method name must be a non-empty string")
    if method in BUILTIN_METHODS or (method in CUSTOM_SCHEDULES and not replace):
        raise ValueError(f"reward method {method!r} is already registered")
    if not callable(builder):
        raise TypeError(f"builder for {method!r} must be callable")
    if section is not None and not (isinstance(section, type) and dataclasses.is_dataclass(section)):
        raise TypeError(f"the section of {method!r} must be a dataclass, got {section!r}")
    CUSTOM_SCHEDULES[method] = builder
    REWARD_SECTIONS.pop(method, None)
    if section is not None:
        REWARD_SECTIONS[method] = section
