"""Issue #64's measurement: a type-balanced held-out split, cost regret against the perfect router,
headline figures from the last snapshots (``experiments.eval.harness``), and the routing study's
stage-2-only trainer options (``experiments.studies.routing``)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.eval.harness import cost_regret, last_snapshots, last_snapshots_text, router_cost
from experiments.recipe.routing import (CONTROL_STAGE, REPO, STAGES, SeedSettings, branch_headlines,
                                        headlines_over_seeds, issue64_markdown, issue64_targets, markdown,
                                        reference_router_costs, regret_by_stage, runtime_differs, stage2_effect,
                                        stage_configs, summarise, target_line)
from experiments.studies.routing import build_parser
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


# ----------------------------------------------------------------------------- issue #64's headline figures and targets

REFERENCE = {"perfect": 30_000.0, "always_graph": 80_000.0, "always_passage": 500.0}


def _evaluation(acc_graph, acc_direct, em_graph, em_direct, cost):
    return {"graph_only": {"routing_accuracy": acc_graph, "em": em_graph, "graph_preference": 0.8},
            "direct": {"routing_accuracy": acc_direct, "em": em_direct, "graph_preference": 0.3},
            "all": {"em": (em_graph + em_direct) / 2, "cost_per_question": cost}}


def _run(seed, branches):
    """A seed's snapshots: ``{branch: [(step, evaluation), ...]}``."""
    return {"seed": seed, "snapshots": {b: [{"step": s, "evaluation": e} for s, e in snaps] for b, snaps in branches.items()}}


def test_headline_figures_are_the_mean_of_the_last_three_snapshots_by_hand():
    snaps = [(2, _evaluation(0.0, 0.0, 0.0, 0.0, 80_000.0)), (4, _evaluation(0.8, 0.9, 0.7, 0.8, 40_000.0)),
             (6, _evaluation(0.9, 1.0, 0.8, 0.9, 35_000.0)), (8, _evaluation(1.0, 0.8, 0.9, 1.0, 30_000.0))]
    heads = branch_headlines([{"step": s, "evaluation": e} for s, e in snaps], REFERENCE)
    assert heads["routing_accuracy/graph_only"]["mean"] == pytest.approx(0.9)  # (0.8 + 0.9 + 1.0) / 3: step 2 left out
    assert heads["routing_accuracy/direct"]["mean"] == pytest.approx(0.9)
    assert heads["cost_per_question"]["mean"] == pytest.approx(35_000.0)
    assert heads["mode_slot_gap"]["mean"] == pytest.approx(0.8 - 0.3)
    # regret of each snapshot: 0.2, 0.1, 0.0 -> 0.1 (= the regret of the mean cost: the map is affine)
    assert heads["cost_regret"]["mean"] == pytest.approx(0.1)
    assert [s["step"] for s in heads["em/direct"]["snapshots"]] == [4, 6, 8]


def _headlines(stage2, control):
    runs = [_run(seed, {"stage 2": [(2, a), (4, a), (6, a)], **({"control": [(2, b), (4, b), (6, b)]} if b else {})})
            for seed, (a, b) in enumerate(zip(stage2, control))]
    return {branch: headlines_over_seeds(runs, branch, REFERENCE) for branch in ("stage 2", "control")
            if any(branch in r["snapshots"] for r in runs)}


def _by_name(targets):
    return {t["name"]: t for t in targets}


def test_issue64_targets_by_hand_on_three_seeds():
    stage2 = [_evaluation(0.95, 0.92, 0.85, 0.90, 38_000.0), _evaluation(0.90, 0.95, 0.80, 0.88, 40_000.0),
              _evaluation(0.92, 0.86, 0.78, 0.92, 36_000.0)]
    control = [_evaluation(1.0, 0.1, 0.90, 0.90, 79_000.0), _evaluation(1.0, 0.0, 0.84, 0.93, 80_000.0),
               _evaluation(1.0, 0.0, 0.87, 0.91, 78_000.0)]
    heads = _headlines(stage2, control)
    assert heads["control"]["em/graph_only"]["spread"] == pytest.approx(0.06)  # max − min of 0.90, 0.84, 0.87
    targets = _by_name(issue64_targets(heads))
    # routing accuracy: graph_only (0.95 + 0.90 + 0.92) / 3 = 0.923 met; direct (0.92 + 0.95 + 0.86) / 3 = 0.91 met
    assert targets["routing accuracy at the mode slot, graph_only"]["value"] == pytest.approx(0.9233333)
    assert targets["routing accuracy at the mode slot, graph_only"]["met"] is True
    assert targets["routing accuracy at the mode slot, direct"]["met"] is True
    # regret: mean cost 38,000 -> (38,000 − 30,000) / 50,000 = 0.16 <= 0.2
    assert targets["cost regret against the perfect router"]["value"] == pytest.approx(0.16)
    assert targets["cost regret against the perfect router"]["met"] is True
    # graph_only EM: stage 2 0.81 vs control 0.87 − 0.06 = 0.81: met at the edge; direct 0.90 vs 0.913 − 0.03 met
    em = targets["graph_only EM, stage 2 vs the EM-only control"]
    assert em["value"] == pytest.approx(0.81) and em["threshold"] == pytest.approx(0.81) and em["met"] is True
    assert targets["direct EM, stage 2 vs the EM-only control"]["met"] is True
    # cost: 38,000 / 79,000 = 0.481 <= 0.7
    cost = targets["cost per question, stage 2 / the EM-only control"]
    assert cost["value"] == pytest.approx(38_000 / 79_000) and cost["met"] is True
    effect = stage2_effect(heads)
    assert effect["em/graph_only"]["difference"] == pytest.approx(0.81 - 0.87)
    assert effect["em/graph_only"]["per_seed"] == pytest.approx([-0.05, -0.04, -0.09])


def test_issue64_targets_missed_and_undecided():
    # one seed: the control's spread is unavailable, so the EM comparison is undecided, not invented
    heads = _headlines([_evaluation(0.85, 0.95, 0.80, 0.90, 60_000.0)], [_evaluation(1.0, 0.0, 0.85, 0.90, 70_000.0)])
    targets = _by_name(issue64_targets(heads))
    assert targets["routing accuracy at the mode slot, graph_only"]["met"] is False  # 0.85 < 0.9
    assert targets["routing accuracy at the mode slot, direct"]["value"] == pytest.approx(0.95)  # each type its own
    assert targets["routing accuracy at the mode slot, direct"]["met"] is True
    assert targets["cost regret against the perfect router"]["value"] == pytest.approx(0.6)
    assert targets["cost regret against the perfect router"]["met"] is False
    em = targets["graph_only EM, stage 2 vs the EM-only control"]
    assert em["met"] is None and "spread unavailable (1 seed)" in em["note"] and "-0.050" in em["note"]
    assert targets["cost per question, stage 2 / the EM-only control"]["met"] is False  # 60/70 = 0.857 > 0.7
    assert "undecided (spread unavailable (1 seed)" in target_line(em)
    assert target_line(targets["cost regret against the perfect router"]).endswith("-> NOT met")
    # no control: its targets are undecided and say why
    targets = _by_name(issue64_targets(_headlines([_evaluation(0.95, 0.95, 0.8, 0.9, 35_000.0)], [None])))
    assert targets["direct EM, stage 2 vs the EM-only control"]["met"] is None
    assert targets["cost per question, stage 2 / the EM-only control"]["note"].startswith("no EM-only control")
    assert targets["routing accuracy at the mode slot, direct"]["met"] is True
    # cheaper than the perfect router by routing every question to the passages (the 2026-12-02
    # pilot's end): cost 529 -> (529 − 30,000) / 50,000 = −0.589, far from 0 -> not met
    regret = _by_name(issue64_targets(_headlines([_evaluation(0.0, 1.0, 0.02, 0.73, 529.0)], [None])))[
        "cost regret against the perfect router"]
    assert regret["value"] == pytest.approx((529 - 30_000) / 50_000) and regret["met"] is False
    # a snapshot without the mode slot read: no value, not met
    heads = _headlines([_evaluation(None, None, 0.8, 0.9, 35_000.0)], [None])
    assert _by_name(issue64_targets(heads))["routing accuracy at the mode slot, direct"] == {
        "name": "routing accuracy at the mode slot, direct", "value": None, "target": ">= 0.9", "met": False}


def test_the_report_shows_each_snapshot_the_headlines_and_the_targets():
    stage2 = [_evaluation(0.95, 0.92, 0.85, 0.90, 38_000.0)]
    heads = _headlines(stage2, [_evaluation(1.0, 0.1, 0.90, 0.90, 79_000.0)])
    runs = [_run(0, {"stage 2": [(2, stage2[0]), (4, stage2[0]), (6, stage2[0])]})]
    report = {"snapshot_every": 2, "seed_runs": runs, "reference_router_costs": REFERENCE, "headlines": heads,
              "stage2_effect": stage2_effect(heads), "issue64_targets": issue64_targets(heads)}
    text = "\n".join(issue64_markdown(report))
    assert "| 0 | stage 2 | 4 | 0.950 | 0.920 | +0.500 | 0.850 | 0.900 | 38,000 | 0.160 |" in text
    assert "| cost_per_question | 38,000 | 79,000 | -41,000 |" in text
    assert "- stage 2, em/direct, seed 0: 0.900 (steps 2 / 4 / 6: 0.900 / 0.900 / 0.900)" in text
    assert "- cost regret against the perfect router: 0.160 vs |regret| <= 0.2 -> met" in text
    assert issue64_markdown({"seed_runs": runs}) == []  # a report without snapshots: no such sections


def test_issue42s_report_still_renders():
    report = json.loads((REPO / "docs" / "runs" / "issue42" / "report.json").read_text(encoding="utf-8"))
    text = markdown(report)
    assert "## Targets (issue #42: routing that depends on the question)" in text and "issue #64" not in text
    assert summarise(report["seed_runs"])  # their seed runs, read as the study reads them (no control stage)


def test_the_control_row_joins_the_table():
    evaluation = {"all": {"em": 0.5, "cost_per_question": 10.0}}
    run = {"evaluations": {stage: evaluation for stage in (*STAGES, CONTROL_STAGE)}}
    assert list(summarise([run, run])) == [*STAGES, CONTROL_STAGE]
    del run["evaluations"][CONTROL_STAGE]
    assert list(summarise([run])) == list(STAGES)
