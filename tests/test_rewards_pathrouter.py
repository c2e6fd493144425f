"""PathRouter: R = F1 + 0.5·EO + shaping, and the four routes, worked by hand."""

import pytest

from raggym.algorithms import Route
from raggym.rewards import (
    EpisodeOutcome,
    PathRouterConfig,
    count_redundant_retrievals,
    is_correct,
    pathrouter_reward,
    pathrouter_reward_terms,
    pathrouter_route,
)

GOLD_PASSAGE = "Paris is the capital of France"


def test_correct_multi_turn_with_evidence():
    o = EpisodeOutcome(
        answer="Paris",
        gold_answers=("Paris",),
        queries=("capital of France", "France continent"),
        retrieved_ids=(("p1",), ("p2",)),
        retrieved_texts=((GOLD_PASSAGE,), ("France is in Europe",)),
        gold_passages=(GOLD_PASSAGE,),
    )
    terms = pathrouter_reward_terms(o)
    # retrieved tokens (9): paris is capital of france france is in europe
    # gold (5): paris is capital of france → all 5 shared; P = 5/9, R = 1, F1 = 10/14 = 5/7
    assert terms["eo"] == pytest.approx(5 / 7)
    assert terms["multi_turn"] == 0.2  # correct and 2 retrievals
    assert terms["lazy"] == 0.0 and terms["timeout"] == 0.0 and terms["redundant"] == 0.0
    # R = 1 + 0.5·5/7 + 0.2
    assert pathrouter_reward(o) == pytest.approx(1.2 + 5 / 14)
    assert pathrouter_route(o) == Route.CORRECT_SUPPORTED


def test_lazy_wrong_single_turn():
    o = EpisodeOutcome(
        answer="Berlin",
        gold_answers=("Paris",),
        queries=("capital",),
        retrieved_ids=(("p9",),),
        retrieved_texts=(("Berlin big city",),),
        gold_passages=(GOLD_PASSAGE,),
    )
    # F1 = 0, EO = 0 (no shared token), one retrieval then an answer → lazy −0.25
    assert pathrouter_reward(o) == pytest.approx(-0.25)
    assert pathrouter_route(o) == Route.INCORRECT_UNSUPPORTED


def test_correct_shortcut_is_lazy_and_unsupported():
    o = EpisodeOutcome(
        answer="Paris",
        gold_answers=("Paris",),
        queries=("museum",),
        retrieved_ids=(("p4",),),
        retrieved_texts=(("Louvre museum",),),
        gold_passages=("The Eiffel Tower stands in Paris",),
    )
    # F1 = 1, EO = 0, lazy −0.25 → 0.75
    assert pathrouter_reward(o) == pytest.approx(0.75)
    assert pathrouter_route(o) == Route.CORRECT_UNSUPPORTED


def test_wrong_but_supported_route():
    o = EpisodeOutcome(
        answer="Lyon",
        gold_answers=("Paris",),
        queries=("a", "b"),
        retrieved_ids=(("p1",), ("p2",)),
        retrieved_texts=((GOLD_PASSAGE,), ("Lyon",)),
        gold_passages=(GOLD_PASSAGE,),
    )
    # retrieved tokens (6): paris is capital of france lyon; P = 5/6, R = 1, EO = 10/11
    terms = pathrouter_reward_terms(o)
    assert terms["eo"] == pytest.approx(10 / 11)
    assert terms["total"] == pytest.approx(0.5 * 10 / 11)  # F1 = 0, no shaping
    assert pathrouter_route(o) == Route.INCORRECT_SUPPORTED


def test_timeout_and_redundant_retrievals():
    o = EpisodeOutcome(
        answer=None,
        gold_answers=("Paris",),
        queries=("a", "b", "c", "d"),
        retrieved_ids=(("p1", "p2"), ("p2", "p1"), ("p3",), ("p1",)),
        retrieved_texts=(("x", "y"), ("y", "x"), ("z",), ("x",)),
        truncated=True,
    )
    # calls 2 and 4 only return passages already seen → 2 × −0.1; timeout −0.5; no EO (no gold)
    terms = pathrouter_reward_terms(o)
    assert terms["redundant"] == pytest.approx(-0.2)
    assert terms["timeout"] == -0.5
    assert terms["lazy"] == 0.0  # it did not stop by answering
    assert terms["total"] == pytest.approx(-0.7)


def test_redundancy_counting_rules():
    assert count_redundant_retrievals([["a"], [], ["a"]]) == 1  # an empty result is not redundant
    assert count_redundant_retrievals([], [["t1"], ["t1"]]) == 1  # falls back to texts
    assert count_redundant_retrievals([["a", "b"], ["b", "c"]]) == 0  # one new passage suffices


def test_correctness_threshold_and_config():
    # "Paris France" vs "Paris": P = 1/2, R = 1, F1 = 2/3 ≥ 0.5 → correct
    assert is_correct(0.0, 2 / 3)
    assert not is_correct(0.0, 0.49)
    assert is_correct(1.0, 0.0)
    o = EpisodeOutcome(answer="Paris France", gold_answers=("Paris",))
    # no retrieval, answered, EO 0 → lazy; F1 = 2/3
    assert pathrouter_reward(o) == pytest.approx(2 / 3 - 0.25)
    assert pathrouter_reward(o, PathRouterConfig(lazy_penalty=0.0)) == pytest.approx(2 / 3)
