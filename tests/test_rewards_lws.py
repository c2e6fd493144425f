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
    # Eq. 8: Σ_{i<j} cos / (RC·(RC−1)) = (2/√2) / 6 = √2/6 ≈ 0.2357, half the pair mean
    assert lws_search_reward(["a", "b", "c"], query_embeddings=e) == pytest.approx(-math.sqrt(2) / 6)
    pair_mean = LWSConfig(similarity_normaliser="pair_mean")
    assert lws_search_reward(["a", "b", "c"], query_embeddings=e, config=pair_mean) == pytest.approx(-math.sqrt(2) / 3)
    # Identical queries are maximally redundant: one pair, cos 1 → −1/(2·1) under Eq. 8, −1 as a mean.
    table = {"x": [1.0, 2.0], "y": [1.0, 2.0]}
    embed = lambda qs: np.array([table[q] for q in qs])  # noqa: E731
    assert lws_search_reward(["x", "y"], embed=embed) == pytest.approx(-0.5)
    assert lws_search_reward(["x", "y"], embed=embed, config=pair_mean) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="similarity_normaliser"):
        LWSConfig(similarity_normaliser="mean")
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
    assert lws_is_correct("anything", ["Paris"], judge=lambda q, a, g: a == "anything")
    # the judge sees the question too
    seen = []
    lws_is_correct("Paris", ["Paris"], judge=lambda q, a, g: seen.append((q, a, tuple(g))) or True, question="Capital?")
    assert seen == [("Capital?", "Paris", ("Paris",))]


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
    # format −1, search −0.6/(2·1) = −0.3 (Eq. 8), answer −1 + 0.3·2 = −0.4 → −1.7
    assert terms == pytest.approx({"format": -1.0, "search": -0.3, "answer": -0.4, "total": -1.7})


def test_format_needs_environment_flag_and_text_structure():
    o = EpisodeOutcome(answer="x", gold_answers=("x",), format_ok=False)
    assert lws_reward_terms(o, stage=1)["format"] == -1.0
    assert lws_reward_terms(EpisodeOutcome(answer="x", gold_answers=("x",)), stage=1)["format"] == 1.0
    flagged = EpisodeOutcome(answer="330 metres", gold_answers=("330 metres",),
                             queries=("Eiffel Tower height",), response_text=RESPONSE, format_ok=False)
    assert lws_reward_terms(flagged, stage=1)["format"] == -1.0


# --- the judge decides "correct" (a judge is a callable (question, prediction, golds) -> bool) ----


def _alias_judge(question, prediction, golds):
    """A judge that knows one alias EM cannot see, and rejects a hedge EM/F1 would accept."""
    if question == "Who wrote Hamlet?":
        return prediction.strip().lower() in ("shakespeare", "the bard", "william shakespeare")
    return prediction.strip().lower() in (g.lower() for g in golds)


def test_reward_follows_the_judge_where_it_disagrees_with_em():
    from raggym.rewards.lws import lws_batch_rewards

    alias = EpisodeOutcome(answer="the Bard", gold_answers=("William Shakespeare",), question="Who wrote Hamlet?",
                           queries=("Hamlet author",), response_text=RESPONSE.replace("330 metres", "the Bard"))
    hedge = EpisodeOutcome(answer="Paris or Lyon", gold_answers=("Paris",), question="Capital of France?",
                           queries=("France capital",), response_text=RESPONSE.replace("330 metres", "Paris or Lyon"))
    # EM/F1 fallback: "the Bard" has F1 0 → wrong; "Paris or Lyon" has F1 2·(1/3)·1/(4/3) = 0.5 → correct
    assert [lws_is_correct(o.answer, o.gold_answers) for o in (alias, hedge)] == [False, True]
    # stage 1, one concise query, format +1: wrong → 1 + 0 + (−1 + 0.3) = 0.3; correct → 1 + 0 + 1 = 2
    assert lws_batch_rewards([alias, hedge], 1) == pytest.approx([0.3, 2.0])
    # the judge flips both verdicts
    assert lws_batch_rewards([alias, hedge], 1, judge=_alias_judge) == pytest.approx([2.0, 0.3])
    # stage 2: correct → 1 + 0 + (1 − 0.3) = 1.7; wrong → 1 + 0 − 1 = 0
    assert lws_batch_rewards([alias, hedge], 2, judge=_alias_judge) == pytest.approx([1.7, 0.0])
    assert lws_reward(alias, 2, judge=_alias_judge) == pytest.approx(1.7)


def test_schedule_from_config_uses_the_judge():
    from raggym.rewards.schedules import reward_schedule_from_config

    alias = EpisodeOutcome(answer="the Bard", gold_answers=("William Shakespeare",), question="Who wrote Hamlet?")
    schedule = reward_schedule_from_config({"method": "lws", "stage2_start": 1}, judge=_alias_judge)
    # no response text, env format ok → +1; no query → 0; stage 1 correct → 1; stage 2 → 1 − 0
    assert schedule(0)([alias]) == pytest.approx([2.0])
    assert reward_schedule_from_config({"method": "lws", "stage2_start": 1})(0)([alias]) == pytest.approx([0.0])
