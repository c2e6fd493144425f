"""Which Step-GRPO step groups a training run samples per question: the 2n + 1 of R1-Router's
Eq. 11 by default, 2n + 2 with ``advantage.stop_route_group`` (the stop decision as a group)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.recipe.config import ConfigError, load_config
from experiments.recipe.training import episode_requests, golden_steps_for
from test_envs_support import QUESTIONS

CONFIGS = Path(__file__).resolve().parents[1] / "experiments" / "configs"
NOLAN = QUESTIONS[0]  # two golden steps: n = 2


def _phases(cfg) -> list[tuple[str, int]]:
    return [(o["phase"], o["golden_prefix"]) for o in golden_steps_for(cfg, [NOLAN])(NOLAN)]


def test_a_run_samples_the_eq11_groups_by_default():
    cfg = load_config(str(CONFIGS / "r1_router.yaml"))
    assert cfg.advantage.stop_route_group is False
    assert _phases(cfg) == [("route", 0), ("answer", 0), ("route", 1), ("answer", 1), ("final", 2)]  # 2n + 1 = 5
    requests = episode_requests([NOLAN], "0", 2, golden_steps_for(cfg, [NOLAN]))
    assert sorted({r.step_index for r in requests}) == list(range(5))


def test_stop_route_group_adds_the_routing_step_whose_gold_is_to_stop():
    cfg = load_config(str(CONFIGS / "r1_router.yaml"), ["advantage.stop_route_group=true"])
    assert _phases(cfg) == [("route", 0), ("answer", 0), ("route", 1), ("answer", 1), ("route", 2), ("final", 2)]


def test_stop_route_group_needs_step_grpo():
    with pytest.raises(ConfigError, match="advantage.stop_route_group"):
        load_config(str(CONFIGS / "search_r1.yaml"), ["advantage.stop_route_group=true"])
