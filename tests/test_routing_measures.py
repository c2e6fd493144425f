"""Issue #64's measurement: a type-balanced held-out split, cost regret against the perfect router,
headline figures from the last snapshots (``experiments.evaluate``), and the routing study's
stage-2-only trainer options (``experiments.studies.routing``)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.evaluate import cost_regret, last_snapshots, last_snapshots_text, router_cost
from experiments.studies.routing import (SeedSettings, build_parser, reference_router_costs, regret_by_stage,
                                         runtime_differs, stage_configs)
from raggym.data import Question
from raggym.data.splits import hold_out, hold_out_balanced


def _question(i: int, kind: str) -> Question:
    return Question(id=f"q{i}", question=f"question {i}?", answers=("a",), kind=kind)


# ----------------------------------------------------------------------------- held-out split


@settings(max_examples=50, deadline=None)
@given(kinds=st.lists(st.sampled_from(["direct", "graph_only"]), min_size=2, max_size=60), per_value=st.integers(0, 6),
       seed=st.integers(0, 1000))
def test_the_balanced_held_out_split_takes_as_many_of_each_type(kinds, per_value, seed):
    questions = [_question(i, k) for i, k in enumerate(kinds)]
    counts = Counter(kinds)
    if min(counts.values()) < per_value:
        with pytest.raises(ValueError, match="cannot hold out"):
            hold_out_balanced(questions, per_value, seed)
        return
    train, heldout = hold_out_balanced(questions, per_value, seed)
    assert Counter(q.kind for q in heldout) == {k: per_value for k in counts if per_value}
    assert sorted(q.id for q in train + heldout) == sorted(q.id for q in questions)  # disjoint, together all
    assert [q for q in questions if q in heldout] == heldout  # input order kept
    # within a type, the held-out questions are those hold_out picks from that type's questions alone
    for kind in counts:
        same = [q for q in questions if q.kind == kind]
        assert [q for q in heldout if q.kind == kind] == hold_out(same, per_value, seed)[1]
    assert hold_out_balanced(list(reversed(questions)), per_value, seed)[1] == list(reversed(heldout))  # order-free


def test_a_question_without_the_attribute_is_named():
    with pytest.raises(ValueError, match="question 'q1' has no 'kind'"):
        hold_out_balanced([_question(0, "direct"), Question(id="q1", question="?", answers=("a",))], 1)


# ----------------------------------------------------------------------------- cost regret

COSTS = {"a": {"passage": 500.0, "graph": 80_000.0}, "b": {"passage": 600.0, "graph": 90_000.0},
         "c": {"passage": 400.0, "graph": 70_000.0}}
KINDS = {"a": "direct", "b": "graph_only", "c": "direct"}


def test_reference_routers_and_regret_by_hand():
    ref = reference_router_costs(COSTS, KINDS)
    # perfect: a and c by passage, b by graph: (500 + 90,000 + 400) / 3 = 30,300
    assert ref == {"perfect": pytest.approx(30_300.0), "always_graph": pytest.approx(80_000.0),
                   "always_passage": pytest.approx(500.0)}
    # a policy costing 55,150 per question is halfway: (55,150 − 30,300) / (80,000 − 30,300) = 0.5
    assert cost_regret(55_150.0, ref["perfect"], ref["always_graph"]) == pytest.approx(0.5)
    assert cost_regret(500.0, ref["perfect"], ref["always_graph"]) == pytest.approx((500 - 30_300) / 49_700)  # < 0: saves by misrouting
    assert cost_regret(10.0, 20.0, 20.0) is None  # nothing to route away from the graph
    assert router_cost(COSTS, {"a": "graph", "b": "passage", "c": "graph"}) == pytest.approx((80_000 + 600 + 70_000) / 3)
    table = {"after stage 2": {"all": {"cost_per_question": {"mean": 55_150.0, "per_seed": [30_300.0, 80_000.0, None]}}}}
    assert regret_by_stage(table, ref) == {"after stage 2": {"mean": pytest.approx(0.5), "per_seed": [0.0, 1.0, None]}}


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.tuples(st.floats(1, 999), st.floats(1e3, 1e5), st.sampled_from(["direct", "graph_only"])),
                      min_size=1, max_size=20),
       routes=st.lists(st.sampled_from(["passage", "graph"]), min_size=20, max_size=20))
def test_regret_is_0_for_the_perfect_router_and_1_for_always_graph(costs, routes):
    mode_costs = {f"q{i}": {"passage": p, "graph": g} for i, (p, g, _) in enumerate(costs)}
    kinds = {f"q{i}": kind for i, (_, _, kind) in enumerate(costs)}
    ref = reference_router_costs(mode_costs, kinds)
    if ref["always_graph"] <= ref["perfect"]:  # every question graph_only: nothing to route
        assert all(k == "graph_only" for k in kinds.values())
        return
    assert cost_regret(ref["perfect"], ref["perfect"], ref["always_graph"]) == pytest.approx(0.0, abs=1e-12)
    assert cost_regret(ref["always_graph"], ref["perfect"], ref["always_graph"]) == pytest.approx(1.0)
    # a router that keeps graph_only questions on the graph lies between them (graph costs more here)
    keeps = {q: "graph" if kinds[q] == "graph_only" else r for q, r in zip(mode_costs, routes)}
    assert -1e-9 <= cost_regret(router_cost(mode_costs, keeps), ref["perfect"], ref["always_graph"]) <= 1 + 1e-9


# ----------------------------------------------------------------------------- snapshots


def test_the_last_three_snapshots_by_hand():
    summary = last_snapshots([(12, 0.81), (2, 0.2), (8, 0.79), (10, 0.83), (6, 0.5)])
    assert summary["mean"] == pytest.approx((0.79 + 0.83 + 0.81) / 3)
    assert summary["snapshots"] == [{"step": 8, "value": 0.79}, {"step": 10, "value": 0.83}, {"step": 12, "value": 0.81}]
    assert last_snapshots_text(summary) == "0.810 (steps 8 / 10 / 12: 0.790 / 0.830 / 0.810)"
    assert last_snapshots([(4, 1.0), (2, 0.0)])["mean"] == 0.5  # fewer snapshots than asked: all of them
    assert last_snapshots([(4, None), (2, 0.0), (6, 1.0)])["mean"] is None  # a missing value is not averaged away
    with pytest.raises(ValueError, match="no snapshots"):
        last_snapshots([])


# ----------------------------------------------------------------------------- stage-2-only options


def test_stage2_overrides_reach_stage_2_only_and_give_it_its_own_runtime():
    args = build_parser().parse_args(["--stage2-override", "learner.loss.mode_entropy_coef=0.1",
                                      "--stage2-override", "data.balance_by=kind",
                                      "learner.loss.mode_entropy_coef=1.0", "learner.loss.mode_pg_coef=2.0"])
    s = SeedSettings(stage1_steps=20, stage2_steps=12, overrides=tuple(args.overrides),
                     stage2_overrides=tuple(args.stage2_overrides))
    stages = stage_configs([*s.overrides], s)
    one, two = stages["stage 1"], stages["stage 2"]
    assert one.learner.loss.mode_entropy_coef == 1.0 and two.learner.loss.mode_entropy_coef == 0.1
    assert one.learner.loss.mode_pg_coef == two.learner.loss.mode_pg_coef == 2.0  # the run's options reach both
    assert one.data.balance_by is None and two.data.balance_by == "kind"
    assert (one.run.steps, two.run.steps) == (20, 32) and one.run.resume and two.run.resume
    # the learners are built with stage 1's loss: stage 2 needs a runtime of its own, an unchanged one does not
    assert runtime_differs(one, two) == ["learner"]
    same = stage_configs([], SeedSettings())
    assert runtime_differs(same["stage 1"], same["stage 2"]) == []
    assert build_parser().parse_args([]).stage2_overrides == [] and build_parser().parse_args([]).heldout_per_type == 0
