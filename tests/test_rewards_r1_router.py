"""R1-Router step rewards, worked by hand."""

import numpy as np
import pytest

from raggym.rewards import (
    EpisodeOutcome,
    chosen_knowledge_bases,
    final_answer_reward,
    intermediate_answer_reward,
    normalized_dot,
    route_is_gold,
    router_step_reward,
)
from raggym.rewards.r1_router import r1_router_step_rewards

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
    assert intermediate_answer_reward(True, "Paris", "Paris France") == 0.5
    assert intermediate_answer_reward(True, None, "Paris") == 0.0
    assert final_answer_reward(True, "It is Paris, France.", "Paris France") == 1.0
    assert final_answer_reward(True, "Paris", "Paris France") == 0.0
    assert final_answer_reward(True, "Paris", ["Paris France", "Paris"]) == 1.0


def test_answer_steps_are_gated_by_r_format():
    # Eq. 10: r(2) = r_format · r_answer. A right answer without its <think> block earns nothing.
    assert intermediate_answer_reward(False, "Paris France", "Paris France") == 0.0  # 0 · 1
    assert intermediate_answer_reward(True, "Paris France", "Paris France") == 1.0   # 1 · 1
    assert final_answer_reward(False, "Paris France", "Paris France") == 0.0         # 0 · 1
    assert final_answer_reward(True, "Paris France", "Paris France") == 1.0          # 1 · 1


def test_final_answer_accuracy_is_cover_exact_match_not_bag_of_tokens_recall():
    # Gold "New York": both tokens occur in "york is a new city" (recall 2/2 = 1), but not as the
    # contiguous span "new york", so accuracy is 0.
    assert final_answer_reward(True, "York is a new city", "New York") == 0.0
    # The span inside a longer answer counts, after SQuAD normalisation (case, punctuation, articles).
    assert final_answer_reward(True, "It is New York, of course.", "the new york") == 1.0
    # Whole tokens only: the gold "1" is not inside "1990".
    assert final_answer_reward(True, "in 1990", "1") == 0.0


def test_step_format_needs_the_think_block_and_no_env_error():
    from raggym.rewards.r1_router import step_format_ok

    def step(well_formed, format_error=False):
        return {"format_error": format_error, "action": {"kind": "route", "well_formed": well_formed}}

    assert step_format_ok(step(True))
    assert not step_format_ok(step(False))  # a route without <think> (or with stray text)
    assert not step_format_ok(step(True, format_error=True))
    assert not step_format_ok({"format_error": False})  # no parsed action recorded: not well formed


def _answer_outcome(phase, answer, gold, well_formed):
    """One recorded teacher-forced answer step, as ``RouteStepRecord.as_dict()`` writes it."""
    step = {"phase": phase, "route_step": 0, "format_error": False, "answer": answer,
            "gold_answer": gold, "action": {"kind": "answer", "well_formed": well_formed}}
    return EpisodeOutcome(answer=answer, gold_answers=(gold,), prompt_id="0:q", steps=(step,))


def test_step_rewards_of_answer_steps_hand_computed():
    def no_routes(texts):
        assert not texts  # answer steps embed nothing
        return np.zeros((0, 2))

    outcomes = [
        _answer_outcome("answer", "Christopher Nolan", "Christopher Nolan", well_formed=True),   # 1 · 2/2
        _answer_outcome("answer", "Christopher Nolan", "Christopher Nolan", well_formed=False),  # 0 · 2/2 (no <think>)
        _answer_outcome("answer", "Nolan", "Christopher Nolan", well_formed=True),               # 1 · 1/2
        _answer_outcome("final", "London", "London", well_formed=True),                          # 1 · 1
        _answer_outcome("final", "London", "London", well_formed=False),                         # 0 · 1 (no <think>)
        _answer_outcome("final", "York is a new city", "New York", well_formed=True),            # 1 · 0: recall 1, no span
        _answer_outcome("final", "born in New York City", "New York", well_formed=True),         # 1 · 1: the span occurs
    ]
    assert r1_router_step_rewards(outcomes, no_routes) == pytest.approx([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0])
