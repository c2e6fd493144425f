"""Hand-computed checks of the answer and evidence metrics and of EpisodeOutcome."""

import math

import pytest

from raggym.rewards import (
    EpisodeOutcome,
    cover_exact_match,
    evidence_overlap,
    exact_match,
    normalize_answer,
    outcome_metrics,
    retrieval_count,
    token_f1,
    token_recall,
    total_retrieval_cost,
    total_retrieval_seconds,
    unsupported_answer_rate,
)


# --- normalisation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("The  Eiffel-Tower!", "eiffeltower"),  # lower, punctuation out, article out
        ("  An apple,  a PEAR and the plum. ", "apple pear and plum"),
        ("theatre", "theatre"),  # "the" only goes as a whole word
        ("A", ""),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


# --- EM / cover-EM ---------------------------------------------------------------------------


def test_exact_match_uses_normalisation_and_aliases():
    assert exact_match("the Eiffel Tower.", "Eiffel tower") == 1.0
    assert exact_match("Eiffel", "Eiffel Tower") == 0.0
    # Max over aliases: the second alias matches.
    assert exact_match("JFK", ["John F. Kennedy", "JFK"]) == 1.0
    assert exact_match(None, "anything") == 0.0


def test_cover_exact_match_is_token_containment():
    assert cover_exact_match("It was Paris, France", "paris") == 1.0
    assert cover_exact_match("It was Paris, France", "Paris France") == 1.0
    assert cover_exact_match("In 1990", "1") == 0.0  # "1" is not a token of "in 1990"
    assert cover_exact_match("Parisian", "Paris") == 0.0
    assert cover_exact_match("whatever", "the") == 0.0  # empty gold never contained
    assert cover_exact_match(None, "x") == 0.0


# --- token F1 / recall -----------------------------------------------------------------------


def test_token_f1_hand_computed():
    # pred tokens [barack, obama, junior], gold [barack, hussein, obama]: 2 in common.
    # P = 2/3, R = 2/3, F1 = 2·(2/3)(2/3)/(4/3) = 2/3.
    assert token_f1("Barack Obama junior", "Barack Hussein Obama") == pytest.approx(2 / 3)
    # Articles vanish: pred [cat, sat], gold [cat, sat, on, mat]; P = 1, R = 1/2, F1 = 2/3.
    assert token_f1("the cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)
    # Multiset overlap: [x, x, y] vs [x, y, y] share one x and one y; P = R = 2/3.
    assert token_f1("x x y", "x y y") == pytest.approx(2 / 3)
    assert token_f1("nothing shared", "other words") == 0.0
    assert token_f1(None, "x") == 0.0


def test_token_f1_takes_max_over_aliases():
    # vs "Barack Obama": P = 1, R = 1/2 → 2/3; vs "Obama": exact → 1.
    assert token_f1("Obama", ["Barack Obama", "Obama"]) == 1.0


def test_token_f1_empty_convention():
    assert token_f1("the", "a") == 1.0  # both normalise to nothing
    assert token_f1("the", "Paris") == 0.0


def test_token_recall_hand_computed():
    assert token_recall("Paris", "Paris France") == 0.5  # 1 of 2 reference tokens
    assert token_recall("France, Paris and more", "Paris France") == 1.0
    assert token_recall("Paris", ["Paris France", "Paris"]) == 1.0
    assert token_recall(None, "Paris") == 0.0


def test_gold_list_must_not_be_empty():
    with pytest.raises(ValueError):
        exact_match("x", [])


# --- EO and UAR ------------------------------------------------------------------------------


def test_evidence_overlap_hand_computed():
    retrieved = ["Paris is in France", "Berlin"]
    gold = ["Paris is the capital of France", "Berlin is big"]
    # retrieved tokens: [paris, is, in, france, berlin] (5)
    # gold 1: [paris, is, capital, of, france] (5); common 3 → P = 3/5, R = 3/5, F1 = 0.6
    # gold 2: [berlin, is, big] (3); common 2 → P = 2/5, R = 2/3, F1 = 2·(4/15)/(16/15) = 0.5
    # EO = (0.6 + 0.5) / 2 = 0.55
    assert evidence_overlap(retrieved, gold) == pytest.approx(0.55)


def test_evidence_overlap_without_gold_is_zero():
    assert evidence_overlap(["anything"], []) == 0.0


def test_unsupported_answer_rate_hand_computed():
    # answer tokens [paris, in, summer]; only "summer" is absent from the retrieved text.
    assert unsupported_answer_rate("Paris in summer", ["Paris is in France"]) == pytest.approx(1 / 3)
    assert unsupported_answer_rate("Paris", ["paris!"]) == 0.0
    assert unsupported_answer_rate("Rome", []) == 1.0
    assert unsupported_answer_rate(None, ["x"]) is None
    assert unsupported_answer_rate("the", ["x"]) is None


# --- EpisodeOutcome --------------------------------------------------------------------------


def _outcome(**kw):
    base = dict(
        answer="Paris",
        gold_answers=("Paris",),
        queries=("capital of France", "Eiffel Tower city"),
        modes=("passage", "graph"),
        retrieved_ids=(("p1", "p2"), ("p3",)),
        retrieved_texts=(("Paris is in France", "Lyon"), ("Eiffel Tower Paris",)),
        retrieval_seconds=0.25,
        retrieval_cost=7.0,
        gold_passages=("Paris is the capital of France",),
    )
    base.update(kw)
    return EpisodeOutcome(**base)


def test_retrieval_totals():
    o = _outcome()
    assert retrieval_count(o) == 2
    assert total_retrieval_seconds(o) == 0.25
    assert total_retrieval_cost(o) == 7.0
    assert o.all_retrieved_texts() == ["Paris is in France", "Lyon", "Eiffel Tower Paris"]


def test_outcome_metrics_collects_everything():
    m = outcome_metrics(_outcome())
    assert m["em"] == 1.0 and m["f1"] == 1.0 and m["cover_em"] == 1.0
    assert m["uar"] == 0.0
    assert m["retrieval_count"] == 2 and m["retrieval_cost"] == 7.0
    # retrieved tokens (8): paris is in france lyon eiffel tower paris
    # gold (5): paris is capital of france; common: paris, is, france = 3
    # P = 3/8, R = 3/5, F1 = 2·(9/40)/(39/40) = 18/39
    assert m["eo"] == pytest.approx(18 / 39)
    assert outcome_metrics(_outcome(gold_passages=()))["eo"] is None


def test_outcome_rejects_misaligned_retrieval_fields():
    with pytest.raises(ValueError, match="one entry per retrieval"):
        _outcome(queries=("only one",))
    with pytest.raises(ValueError, match="2 ids but 1 texts"):
        _outcome(retrieved_texts=(("a",), ("b",)))
    with pytest.raises(ValueError, match="gold answer"):
        _outcome(gold_answers=())


def test_outcome_from_dict_with_turns_and_aliases():
    record = {
        "final_answer": "Paris",
        "answers": ["Paris", "City of Light"],
        "turns": [
            {"kind": "think"},
            {"query": "capital of France", "mode": "passage", "retrieved_ids": ["p1"],
             "retrieved_texts": ["Paris is in France"], "seconds": 0.1, "cost": 2},
            {"query": "Eiffel", "mode": "graph", "retrieved_ids": ["p2", "p3"],
             "retrieved_texts": ["a", "b"], "seconds": 0.3, "cost": 5},
            {"kind": "answer", "answer": "Paris"},
        ],
        "timeout": False,
        "format_valid": True,
        "question_id": "q7",
        "something_else": 123,
    }
    o = EpisodeOutcome.from_dict(record)
    assert o.answer == "Paris"
    assert o.gold_answers == ("Paris", "City of Light")
    assert o.queries == ("capital of France", "Eiffel")
    assert o.modes == ("passage", "graph")
    assert o.retrieved_ids == (("p1",), ("p2", "p3"))
    assert o.retrieval_count == 2
    assert math.isclose(o.retrieval_seconds, 0.4)
    assert o.retrieval_cost == 7.0
    assert o.prompt_id == "q7"


def test_outcome_from_dict_sums_per_call_lists_and_round_trips():
    o = EpisodeOutcome.from_dict(
        {"answer": None, "gold_answers": "x", "queries": ["a", "b"],
         "retrieval_seconds": [0.5, 0.25], "retrieval_costs": [1, 2], "truncated": True}
    )
    assert o.answer is None and o.truncated
    assert o.retrieval_seconds == 0.75 and o.retrieval_cost == 3.0
    assert EpisodeOutcome.from_dict(_outcome().as_dict()) == _outcome()
