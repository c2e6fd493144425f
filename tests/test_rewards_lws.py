"""LWS: format, search and answer rewards, worked by hand."""

import math

import numpy as np
import pytest

from raggym.rewards import (
    EpisodeOutcome,
    LWSConfig,
    is_concise_query,
    lws_answer_reward,
    lws_format_reward,
    lws_is_correct,
    lws_reward,
    lws_reward_terms,
    lws_search_reward,
    lws_structure_ok,
    mean_pairwise_cosine,
)


@pytest.mark.parametrize(
    "tags, ok",
    [
        (["think", "reflect", "answer"], True),
        (["think", "search", "information", "reflect", "answer"], True),
        (["think", "search", "information", "reflect", "search", "information", "reflect", "answer"], True),
        (["think", "answer"], False),  # reflect is required
        (["think", "search", "information", "answer"], False),  # no reflect after information
        (["search", "information", "reflect", "answer"], False),  # must start with think
        (["think", "reflect", "answer", "think"], False),  # nothing after the answer
        (["think", "search", "reflect", "answer"], False),
        ([], False),
    ],
)
def test_structure_checker(tags, ok):
    assert lws_structure_ok(tags) is ok


def test_format_reward_is_plus_minus_one():
    assert lws_format_reward(True) == 1.0
    assert lws_format_reward(False) == -1.0


@pytest.mark.parametrize(
    "query, concise",
    [
        ("Eiffel Tower height", True),
        ("1998 World Cup winner", True),
        ("what is the height of the Eiffel Tower", False),  # question word
        ("Eiffel Tower height?", False),
        ("please Eiffel Tower height", False),  # filler
        ("search for Eiffel Tower height", False),
        ("one two three four five six seven eight nine ten eleven twelve thirteen", False),  # 13 words
        ("   ", False),
    ],
)
def test_conciseness_rule(query, concise):
    assert is_concise_query(query) is concise


def test_conciseness_is_configurable():
    assert is_concise_query("a b c d", LWSConfig(max_query_words=3)) is False


def test_mean_pairwise_cosine_hand_computed():
    # rows (1,0), (0,1), (1,1): cos12 = 0, cos13 = cos23 = 1/√2
    # mean over the 3 pairs = (2/√2)/3 = √2/3 ≈ 0.4714 (the paper's normaliser would give half)
    e = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert mean_pairwise_cosine(e) == pytest.approx(math.sqrt(2) / 3)
    assert mean_pairwise_cosine(np.array([[2.0, 0.0], [5.0, 0.0]])) == pytest.approx(1.0)


def test_search_reward_cases():
    assert lws_search_reward([]) == 0.0
    assert lws_search_reward(["Eiffel Tower height"]) == 0.0
    assert lws_search_reward(["how tall is the Eiffel Tower"]) == -1.0
    e = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert lws_search_reward(["a", "b", "c"], query_embeddings=e) == pytest.approx(-math.sqrt(2) / 3)
    # Identical queries are maximally redundant.
    table = {"x": [1.0, 2.0], "y": [1.0, 2.0]}
    assert lws_search_reward(["x", "y"], embed=lambda qs: np.array([table[q] for q in qs])) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="embed"):
        lws_search_reward(["a", "b"])


def test_answer_reward_both_stages():
    beta = 0.3
    assert lws_answer_reward(True, 2, stage=1) == 1.0
    assert lws_answer_reward(False, 2, stage=1) == pytest.approx(-1 + beta * 2)  # −0.4
    assert lws_answer_reward(True, 2, stage=2) == pytest.approx(1 - beta * 2)  # 0.4
    assert lws_answer_reward(False, 2, stage=2) == -1.0
    with pytest.raises(ValueError):
        lws_answer_reward(True, 0, stage=3)


def test_correctness_rules_and_judge():
    # "Paris France" vs "Paris": EM 0, F1 2/3
    assert lws_is_correct("Paris France", ["Paris"])  # em_or_f1
    assert not lws_is_correct("Paris France", ["Paris"], LWSConfig(correct_if="em"))
    assert lws_is_correct("Paris France", ["Paris"], LWSConfig(correct_if="f1"))
    assert not lws_is_correct(None, ["Paris"])
    assert lws_is_correct("anything", ["Paris"], judge=lambda a, g: a == "anything")


RESPONSE = (
    "<think>need the height</think>\n<search>Eiffel Tower height</search>\n"
    "<information>Doc 1: The tower is 330 metres tall.</information>\n"
    "<reflect>the document answers it</reflect>\n<answer>330 metres</answer>"
)


def test_full_reward_reads_structure_from_text():
    o = EpisodeOutcome(
        answer="330 metres", gold_answers=("330 metres",), queries=("Eiffel Tower height",),
        response_text=RESPONSE,
    )
    # stage 2: format +1, search 0 (one concise query), answer 1 − 0.3·1 = 0.7 → 1.7
    assert lws_reward(o, stage=2) == pytest.approx(1.7)
    # stage 1: 1 + 0 + 1 = 2
    assert lws_reward(o, stage=1) == pytest.approx(2.0)


def test_full_reward_bad_format_wrong_answer_two_queries():
    o = EpisodeOutcome(
        answer="300", gold_answers=("330 metres",), queries=("tower", "tower height"),
        response_text="<think>x</think><answer>300</answer>",
    )
    e = np.array([[1.0, 0.0], [0.6, 0.8]])  # cosine 0.6
    terms = lws_reward_terms(o, stage=1, query_embeddings=e)
    # format −1, search −0.6, answer −1 + 0.3·2 = −0.4 → −2.0
    assert terms == pytest.approx({"format": -1.0, "search": -0.6, "answer": -0.4, "total": -2.0})


def test_format_needs_environment_flag_and_text_structure():
    o = EpisodeOutcome(answer="x", gold_answers=("x",), format_ok=False)
    assert lws_reward_terms(o, stage=1)["format"] == -1.0
    assert lws_reward_terms(EpisodeOutcome(answer="x", gold_answers=("x",)), stage=1)["format"] == 1.0
    flagged = EpisodeOutcome(answer="330 metres", gold_answers=("330 metres",),
                             queries=("Eiffel Tower height",), response_text=RESPONSE, format_ok=False)
    assert lws_reward_terms(flagged, stage=1)["format"] == -1.0
