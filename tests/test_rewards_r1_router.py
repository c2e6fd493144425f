"""R1-Router step rewards, worked by hand."""

import numpy as np
import pytest

from raggym.rewards import (
    chosen_knowledge_bases,
    final_answer_reward,
    intermediate_answer_reward,
    normalized_dot,
    route_is_gold,
    router_step_reward,
)

KBS = ("text", "table", "image-text")


def test_normalized_dot():
    # (3,4)·(4,3) = 24; norms 5 and 5 → 0.96
    assert normalized_dot(np.array([3.0, 4.0]), np.array([4.0, 3.0])) == pytest.approx(0.96)
    assert normalized_dot(np.array([0.0, 0.0]), np.array([1.0, 0.0])) == 0.0
    with pytest.raises(ValueError):
        normalized_dot(np.ones(2), np.ones(3))


def test_route_needs_exactly_one_valid_kb():
    assert chosen_knowledge_bases(" table ") == ["table"]
    assert chosen_knowledge_bases("table, text") == ["table", "text"]
    assert chosen_knowledge_bases("table and image-text") == ["table", "image-text"]
    assert route_is_gold("Table", "table", KBS)
    assert not route_is_gold("table, text", "table", KBS)  # two KBs
    assert not route_is_gold("spreadsheet", "spreadsheet", KBS)  # not a valid KB
    assert not route_is_gold("text", "table", KBS)
    assert route_is_gold(["image-text"], "image-text", KBS)
    assert route_is_gold("None", "None", KBS + ("None",))


def test_router_step_reward_hand_computed():
    q, gold_q = np.array([3.0, 4.0]), np.array([4.0, 3.0])  # sim 0.96
    # 1 · (0.5·0.96 + 0.5·1) = 0.98
    assert router_step_reward(True, q, gold_q, "table", "table", KBS) == pytest.approx(0.98)
    # wrong route: 0.5·0.96 = 0.48
    assert router_step_reward(True, q, gold_q, "text", "table", KBS) == pytest.approx(0.48)
    assert router_step_reward(True, q, gold_q, "table; text", "table", KBS) == pytest.approx(0.48)
    # r_format = 0 zeroes everything
    assert router_step_reward(False, q, gold_q, "table", "table", KBS) == 0.0


def test_answer_rewards():
    assert intermediate_answer_reward("Paris", "Paris France") == 0.5
    assert intermediate_answer_reward(None, "Paris") == 0.0
    assert final_answer_reward("It is Paris, France.", "Paris France") == 1.0
    assert final_answer_reward("Paris", "Paris France") == 0.0
    assert final_answer_reward("Paris", ["Paris France", "Paris"]) == 1.0


def test_step_format_needs_the_think_block_and_no_env_error():
    from raggym.rewards.r1_router import step_format_ok

    def step(well_formed, format_error=False):
        return {"format_error": format_error, "action": {"kind": "route", "well_formed": well_formed}}

    assert step_format_ok(step(True))
    assert not step_format_ok(step(False))  # a route without <think> (or with stray text)
    assert not step_format_ok(step(True, format_error=True))
    assert not step_format_ok({"format_error": False})  # no parsed action recorded: not well formed
