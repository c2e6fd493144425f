"""The routing task (synthetic ``task="routing"``), format-only SFT modes and the learning-proof
report's arithmetic (``experiments.studies.routing``)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.recipe.routing import (add_preference, graph_share, markdown, right_route, rl_effect,
                                        route_advantages, routing_targets, summarise, targets, training_curves,
                                        typed_metrics, wall_time_line)
from experiments.recipe.sft import with_search_modes
from raggym.data.synthetic import RELATIONS, WorldConfig, generate_world

GRAPH_ONLY = ("born_in", "works_for", "educated_at")


@pytest.fixture(scope="module")
def world():
    return generate_world(3, n_entities=240, n_questions=120, task="routing")


def _relation(q):
    from raggym.data.synthetic import _TRIPLE_RELATION

    return next(r for r in RELATIONS if _TRIPLE_RELATION[r] == q.gold_triples[0][1])


def test_routing_questions_are_one_hop_of_two_types(world):
    kinds = [q.kind for q in world.questions]
    assert set(kinds) == {"graph_only", "direct"}
    assert 0.3 < kinds.count("graph_only") / len(kinds) < 0.7  # graph_only_share 0.5
    for q in world.questions:
        assert q.hops == 1 and len(q.golden_trajectory) == 1 and len(q.gold_passage_ids) == 1
        assert q.golden_trajectory[0]["mode"] == ("graph" if q.kind == "graph_only" else "passage")
        assert (_relation(q) in GRAPH_ONLY) == (q.kind == "graph_only")


def test_graph_only_facts_are_named_by_the_graph_alone(world):
    passages = {p.id: p for p in world.corpus}
    triples_of = {p.id: d["extracted_triples"] for p, d in zip(world.corpus, world.openie["docs"])}
    for q in world.questions:
        gold = passages[q.gold_passage_ids[0]]
        subject = q.gold_triples[0][0]
        assert q.answer in gold.text and subject in q.question
        assert list(q.gold_triples[0]) in triples_of[gold.id]  # the graph ties the fact to its subject
        if q.kind == "direct":
            assert gold.title == subject
        else:  # the text does not: neither title nor sentence names the person
            assert subject not in gold.title and subject not in gold.text and "this person" in gold.text.lower()
    # graph-only facts are not also stated under the person's name
    named = {(t[0], t[1]) for p in world.corpus if not p.title.startswith("Biography no.")
             for t in triples_of[p.id]}
    assert not [q for q in world.questions if q.kind == "graph_only" and tuple(q.gold_triples[0][:2]) in named]


def test_routing_world_is_seeded(world):
    again = generate_world(3, n_entities=240, n_questions=120, task="routing")
    assert [q.question for q in again.questions] == [q.question for q in world.questions]
    assert [p.id for p in again.corpus] == [p.id for p in world.corpus]


@pytest.mark.parametrize("knobs, message", [
    ({"task": "route"}, "task must be"),
    ({"task": "routing", "graph_only_relations": ("flies_to",)}, "unknown relations"),
    ({"task": "routing", "graph_only_relations": ("directed_by",)}, "relations of a person"),
    ({"task": "routing", "graph_only_relations": ()}, "non-empty"),
    ({"task": "routing", "graph_only_share": 1.5}, "graph_only_share"),
])
def test_routing_config_errors(knobs, message):
    with pytest.raises(ValueError, match=message):
        WorldConfig(**knobs)


# ----------------------------------------------------------------------------- SFT modes


def test_search_modes_golden_fixed_and_random(world):
    qs = world.questions[:40]
    assert with_search_modes(qs, "golden") == qs
    fixed = with_search_modes(qs, "passage")
    assert {s["mode"] for q in fixed for s in q.golden_trajectory} == {"passage"}
    assert [s["query"] for q in fixed for s in q.golden_trajectory] == [s["query"] for q in qs for s in q.golden_trajectory]
    drawn = with_search_modes(qs, ("passage", "graph"), seed=5)
    modes = [q.golden_trajectory[0]["mode"] for q in drawn]
    assert 8 < modes.count("graph") < 32
    # independent of the golden mode: graph-only questions get both modes too
    graph_only_modes = [m for q, m in zip(qs, modes) if q.kind == "graph_only"]
    assert "passage" in graph_only_modes and "graph" in graph_only_modes
    with pytest.raises(ValueError, match="non-empty"):
        with_search_modes(qs, ())


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), order=st.permutations(range(12)))
def test_random_modes_depend_only_on_seed_and_question(world, seed, order):
    qs = world.questions[:12]
    base = {q.id: q.golden_trajectory for q in with_search_modes(qs, ("passage", "graph"), seed)}
    shuffled = with_search_modes([qs[i] for i in order], ("passage", "graph"), seed)
    assert {q.id: q.golden_trajectory for q in shuffled} == base


# ----------------------------------------------------------------------------- report arithmetic


def _episode(qid, em, modes, cost):
    return {"question_id": qid, "metrics": {"em": em, "modes": modes, "retrieval_cost": cost}}


def test_typed_metrics_by_hand():
    kinds = {"g1": "graph_only", "g2": "graph_only", "d1": "direct"}
    episodes = [_episode("g1", 1.0, ["graph"], 100.0), _episode("g2", 0.0, ["passage", "hybrid"], 101.0),
                _episode("d1", 1.0, [], 0.0)]
    m = typed_metrics(episodes, kinds)
    assert m["graph_only"] == {"n": 2, "em": 0.5, "graph_share": 2 / 3, "searches_per_question": 1.5, "cost_per_question": 100.5,
                               "route_accuracy": 0.5}  # g1's first search took the graph, g2's a passage
    assert m["direct"]["graph_share"] is None and m["direct"]["em"] == 1.0
    assert m["direct"]["route_accuracy"] == 0.0  # answering without a search is no route
    assert m["all"]["route_accuracy"] == 0.25  # the mean of the types', not of the 3 questions (1/3)
    assert m["all"]["n"] == 3 and m["all"]["cost_per_question"] == pytest.approx(201 / 3)
    assert graph_share(["passage", "passage", "graph", "hybrid"]) == 0.5
    with pytest.raises(ValueError, match="no type"):
        typed_metrics([_episode("zz", 1.0, [], 0.0)], kinds)


def test_repeated_heldout_questions_keep_their_type(tmp_path, world):
    from experiments.recipe.routing import RoutingTask, repeated_questions
    from raggym.data import write_questions

    heldout = world.questions[:5]
    copies = repeated_questions(heldout, 3)
    assert [q.id for q in copies[:3]] == [f"{heldout[0].id}~{j}" for j in range(3)] and len(copies) == 15
    assert all(c.question == heldout[i // 3].question for i, c in enumerate(copies))
    write_questions(tmp_path / "heldout_questions.jsonl", heldout)
    task = RoutingTask(tmp_path, tmp_path / "index", [], heldout, None, {q.id: q.kind for q in heldout})
    (dataset,) = task.heldout_dataset(3)
    assert dataset["questions"].endswith("heldout_questions_x3.jsonl")
    assert task.kinds[f"{heldout[4].id}~2"] == heldout[4].kind
    assert task.heldout_dataset()[0]["questions"].endswith("heldout_questions.jsonl")


def _run(seed, graph_em, graph_share_, cost1, cost2, em1=0.6, em2=0.6):
    def stage(em_alias, share, cost, em_all):
        return {"graph_only": {"em": em_alias, "graph_share": share, "cost_per_question": cost, "searches_per_question": 1.0},
                "all": {"em": em_all, "graph_share": share, "cost_per_question": cost, "searches_per_question": 1.0}}

    return {"seed": seed, "evaluations": {"after SFT": stage(graph_em[0], graph_share_[0], cost1, 0.5),
                                          "after stage 1": stage(graph_em[1], graph_share_[1], cost1, em1),
                                          "after stage 2": stage(graph_em[1], graph_share_[1], cost2, em2)}}


def test_summary_effect_and_targets_by_hand():
    runs = [_run(0, (0.2, 0.5), (0.4, 0.8), 100.0, 60.0, 0.6, 0.58), _run(1, (0.3, 0.5), (0.6, 0.9), 100.0, 80.0, 0.7, 0.7)]
    table = summarise(runs)
    assert table["after SFT"]["graph_only"]["em"]["mean"] == pytest.approx(0.25)
    assert table["after stage 1"]["graph_only"]["graph_share"]["min"] == 0.8
    effect = {(e["question_type"], e["metric"]): e for e in rl_effect(table, 2)}
    assert effect[("graph_only", "em")]["after_sft"] == pytest.approx(0.25) and effect[("graph_only", "em")]["after_rl"] == 0.5
    assert effect[("all", "cost_per_question")]["after_rl"] == 70.0 and effect[("all", "cost_per_question")]["seeds"] == 2
    assert {e["decoding"] for e in effect.values()} == {"greedy"}
    met = {t["name"].removesuffix(" (greedy)"): t for t in targets(table)}
    assert met["graph-only EM gain, stage 1 over SFT"]["value"] == pytest.approx(0.25) and met["graph-only EM gain, stage 1 over SFT"]["met"]
    assert met["graph-only graph share after stage 1"]["value"] == pytest.approx(0.85)
    assert met["cost per question, stage 2 / stage 1"]["value"] == pytest.approx(0.7)
    # EM moved by -0.01 (0.65 -> 0.64) within the seed spread 0.12: met; a 0.2 drop would not be
    assert met["EM change stage 1 -> stage 2 (all) vs seed spread"]["met"]
    # the sampled evaluations are summarised the same way, under their own key; absent: no table
    sampled = [{**r, "sampled_evaluations": r["evaluations"]} for r in runs]
    assert summarise(sampled, "sampled_evaluations") == table and summarise(runs, "sampled_evaluations") == {}
    assert rl_effect({}, 2, "sampled") == []
    assert {e["decoding"] for e in rl_effect(table, 2, "sampled")} == {"sampled"}
    worse = targets(summarise([_run(0, (0.2, 0.3), (0.4, 0.5), 100.0, 90.0, 0.6, 0.3),
                               _run(1, (0.3, 0.35), (0.6, 0.5), 100.0, 95.0, 0.62, 0.35)]))
    assert not any(t["met"] for t in worse)


def test_right_route_by_type():
    assert right_route("graph_only", ["graph"]) and right_route("graph_only", ["hybrid", "passage"])
    assert not right_route("graph_only", ["passage", "graph"]) and not right_route("graph_only", [])
    assert right_route("direct", ["passage"]) and not right_route("direct", ["hybrid"])
    assert right_route("multi_hop", ["graph"]) is None  # no right route known: no accuracy


def test_probe_preference_and_routing_accuracy_by_hand():
    evaluation = {"graph_only": {}, "direct": {}, "all": {}}
    add_preference(evaluation, {"graph_only": [0.8, 0.4], "direct": [0.3, 0.5]})
    assert evaluation["graph_only"]["graph_preference"] == pytest.approx(0.6)
    assert evaluation["direct"]["graph_preference"] == pytest.approx(0.4)
    assert evaluation["all"]["graph_preference"] == pytest.approx(0.5)
    # right: 0.8 (graph_only, > 0.5) and 0.3 (direct, < 0.5); a tie at 0.5 prefers neither route
    assert evaluation["all"]["routing_accuracy"] == 0.5
    # and per type: graph_only 0.8 right, 0.4 wrong; direct 0.3 right, 0.5 a tie (wrong)
    assert evaluation["graph_only"]["routing_accuracy"] == 0.5 and evaluation["direct"]["routing_accuracy"] == 0.5
    other = {"graph_only": {}, "direct": {}, "all": {}}
    add_preference(other, {"graph_only": [0.8, 0.6, 0.1], "direct": [0.9]})
    assert other["graph_only"]["routing_accuracy"] == pytest.approx(2 / 3) and other["direct"]["routing_accuracy"] == 0.0


def _trajectory(qid, modes, advantage, reward=1.0):
    return {"reward": reward, "advantage": advantage, "episode": {"question_id": qid, "modes": modes}}


def test_training_curves_advantage_by_first_route_by_hand(tmp_path):
    kinds = {"g1": "graph_only", "g2": "graph_only", "d1": "direct", "d2": "direct"}
    steps = {1: [_trajectory("g1", ["graph"], 1.0), _trajectory("g2", ["passage"], -1.0), _trajectory("d1", ["graph"], 0.5),
                 _trajectory("d2", ["passage"], -0.5)],
             2: [_trajectory("g1", ["graph"], 0.2), _trajectory("g1", ["hybrid"], 0.4), _trajectory("g2", [], -0.6),
                 _trajectory("d1", ["passage", "graph"], 0.9), _trajectory("d2", ["graph"], -0.9)]}
    for step, rows in steps.items():
        (tmp_path / f"step-{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curves = training_curves(tmp_path, kinds)
    assert [row["step"] for row in curves] == [1, 2]
    assert curves[0]["advantage/graph/graph_only"] == 1.0 and curves[0]["advantage/passage/direct"] == -0.5
    assert curves[1]["advantage/graph/graph_only"] == pytest.approx(0.3)  # graph and hybrid both reach the graph
    assert curves[1]["advantage/passage/graph_only"] is None  # g2 answered without a search
    assert curves[1]["advantage/passage/direct"] == 0.9 and curves[1]["graph_share/direct"] == pytest.approx(2 / 3)
    summary = route_advantages([{"curves": curves}], first_step=1)
    # graph_only: right = graph, ahead at step 1 (1.0 > -1.0); step 2 has no passage episode to compare
    assert summary["graph_only"] == {"right_route": "graph", "advantage_right": pytest.approx(0.65), "advantage_other": -1.0,
                                     "steps_right_ahead": 1, "steps_compared": 1}
    # direct: right = passage, behind at step 1 (-0.5 < 0.5), ahead at step 2 (0.9 > -0.9)
    assert summary["direct"] == {"right_route": "passage", "advantage_right": pytest.approx(0.2),
                                 "advantage_other": pytest.approx(-0.2), "steps_right_ahead": 1, "steps_compared": 2}
    assert route_advantages([{"curves": curves}], first_step=2)["direct"]["steps_compared"] == 1


def _write_run(run_dir, steps, metrics):
    (run_dir / "trajectories").mkdir(parents=True)
    for step, rows in steps.items():
        (run_dir / "trajectories" / f"step-{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


def test_training_blocks_by_hand(tmp_path):
    from experiments.recipe.routing import run_blocks, training_blocks, training_blocks_markdown

    kinds = {"g1": "graph_only", "d1": "direct"}
    t = _trajectory
    steps = {1: [t("g1", ["graph"], 1.0), t("g1", ["passage"], -1.0), t("d1", ["passage"], 0.5), t("d1", ["graph"], -0.5)],
             2: [t("g1", ["graph"], 0.4), t("g1", ["passage"], -0.4), t("d1", ["graph"], 0.2), t("d1", ["passage"], -0.2)],
             3: [t("g1", ["graph"], 0.6), t("d1", ["passage"], 0.3)],
             4: [t("g1", ["passage"], 0.2), t("g1", ["graph"], -0.2), t("d1", ["passage"], 0.8), t("d1", ["graph"], -0.8)]}
    seconds = {1: (60, 50, 10), 2: (90, 80, 10), 3: (100, 130, 10), 4: (150, 140, 10)}
    metrics = [{"step": s, "em": em, "time/rollout": seconds[s][0], "time/learn": seconds[s][1], "time/sync": seconds[s][2]}
               for s, em in ((1, 0.5), (2, 0.0), (2, 0.25), (3, 0.75), (4, 1.0))]  # step 2 redone after a stop: its last record counts
    _write_run(tmp_path, steps, metrics)
    rows = run_blocks(tmp_path, kinds, stage1_steps=1, block=2)
    assert [(r["steps"], r["stage"]) for r in rows] == [((1, 1), 1), ((2, 3), 2), ((4, 4), 2), ((2, 4), 2)]
    first, block, last, stage2 = rows
    assert first["em"] == 0.5 and first["minutes_per_step"] == pytest.approx(2.0)
    assert block["em"] == pytest.approx(0.5) and block["minutes_per_step"] == pytest.approx(3.5)
    assert block["graph_share/graph_only"] == pytest.approx(0.75) and block["graph_share/direct"] == pytest.approx(0.25)
    assert block["route_advantages"]["graph_only"] == {"right_route": "graph", "advantage_right": pytest.approx(0.5),
                                                       "advantage_other": pytest.approx(-0.4), "steps_right_ahead": 1,
                                                       "steps_compared": 1}
    assert block["route_advantages"]["direct"]["steps_right_ahead"] == 0  # passage -0.2 behind graph +0.2 at step 2
    assert last["route_advantages"]["graph_only"]["steps_right_ahead"] == 0
    assert stage2["em"] == pytest.approx(2 / 3) and stage2["graph_share/direct"] == pytest.approx(1 / 3)
    assert stage2["route_advantages"]["direct"]["advantage_right"] == pytest.approx(0.3)
    assert stage2["route_advantages"]["direct"]["advantage_other"] == pytest.approx(-0.3)
    assert (stage2["route_advantages"]["graph_only"]["steps_right_ahead"], stage2["minutes_per_step"]) == (1, pytest.approx(4.0))
    table = training_blocks_markdown(rows)
    assert "| 2-3 | 2 | 0.500 | 0.750 | 0.250 | +0.500 / -0.400 | +0.050 / +0.200 | 1 of 1 / 0 of 1 | 3.5 |" in table
    # a seed still in stage 1 shows only the steps it trained
    assert [r["steps"] for r in run_blocks(tmp_path, kinds, stage1_steps=5, block=2)] == [(1, 2), (3, 4)]
    # one stage-2 block needs no row over all of stage 2
    assert [r["steps"] for r in run_blocks(tmp_path, kinds, stage1_steps=2, block=2)] == [(1, 2), (3, 4)]
    with pytest.raises(ValueError, match="block must be at least 1"):
        training_blocks([], [], stage1_steps=1, block=0)


def test_show_progress_reads_without_training(tmp_path, capsys):
    from experiments.studies.routing import main

    assert main(["--show-progress", "--out", str(tmp_path), "--seeds", "4", "--entities", "240", "--questions", "120"]) == 0
    assert "seed 4: no RL step yet" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # nothing written
    # a finished seed is read from its report, whose curves and metrics outlive the run folder
    curves = [{"step": 1, "reward": 1.0, "graph_share/graph_only": 1.0, "graph_share/direct": 0.0,
               "advantage/graph/graph_only": 0.5, "advantage/passage/graph_only": -0.5,
               "advantage/passage/direct": 0.25, "advantage/graph/direct": -0.25}]
    (tmp_path / "seed4").mkdir()
    (tmp_path / "seed4" / "seed_report.json").write_text(json.dumps(
        {"seed": 4, "curves": curves, "train_metrics": [{"step": 1, "em": 0.75, "time/rollout": 30.0, "time/learn": 90.0}]}))
    assert main(["--show-progress", "--out", str(tmp_path), "--seeds", "4", "--entities", "240", "--questions", "120",
                 "--stage1-steps", "1"]) == 0
    assert "| 1-1 | 1 | 0.750 | 1.000 | 0.000 | +0.500 / -0.500 | +0.250 / -0.250 | 1 of 1 / 1 of 1 | 2.0 |" in capsys.readouterr().out


def _routed_stage(em_graph_only, cost, route_acc, routing_acc=None):
    kinds = {"graph_only": {"em": em_graph_only, "graph_share": 0.5, "cost_per_question": cost, "searches_per_question": 1.0},
             "all": {"em": 0.6, "graph_share": 0.5, "cost_per_question": cost, "searches_per_question": 1.0,
                     "route_accuracy": route_acc}}
    if routing_acc is not None:
        kinds["all"]["routing_accuracy"] = routing_acc
    return kinds


def test_routing_targets_by_hand():
    runs = [{"seed": s, "evaluations": {"after SFT": _routed_stage(0.3, 50.0, 0.5, 0.5),
                                        "after stage 1": _routed_stage(em1, 100.0, 0.5, 0.5),
                                        "after stage 2": _routed_stage(em2, cost2, route2, routing2)}}
            for s, em1, em2, cost2, route2, routing2 in ((0, 0.70, 0.68, 60.0, 0.90, 0.95), (1, 0.80, 0.70, 70.0, 1.00, 0.90),
                                                         (2, 0.75, 0.75, 80.0, 0.95, 0.94))]
    met = {t["name"].removesuffix(" (greedy)"): t for t in routing_targets(summarise(runs))}
    assert met["held-out routing accuracy after stage 2 (mode slot)"]["value"] == pytest.approx(0.93)
    assert met["held-out routing accuracy after stage 2 (first search)"]["value"] == pytest.approx(0.95)
    assert met["cost per question, stage 2 / stage 1"]["value"] == pytest.approx(0.7)
    # graph_only EM after stage 2, mean 0.71, is above stage 1's lowest seed (0.70): holds
    assert met["graph_only EM after stage 2"]["value"] == pytest.approx(0.71)
    assert all(t["met"] for t in met.values())
    runs[1]["evaluations"]["after stage 2"] = _routed_stage(0.40, 95.0, 0.5, 0.6)
    missed = {t["name"].removesuffix(" (greedy)"): t for t in routing_targets(summarise(runs))}
    assert not any(t["met"] for t in missed.values()), missed
    # seed 0 evaluated before the mode-slot accuracy was recorded: the mean is over the others
    runs[0]["evaluations"]["after stage 2"].pop("all")
    runs[0]["evaluations"]["after stage 2"]["all"] = {"em": 0.6, "graph_share": 0.5, "cost_per_question": 60.0,
                                                      "searches_per_question": 1.0}
    table = summarise(runs)
    assert table["after stage 2"]["all"]["routing_accuracy"]["per_seed"] == [None, 0.6, 0.94]
    assert table["after stage 2"]["all"]["routing_accuracy"]["mean"] == pytest.approx(0.77)
    # no value at all: reported as None, not met, and the report still renders it
    nothing = routing_targets({})
    assert all(t["value"] is None and not t["met"] for t in nothing) and len(nothing) == 4
    assert [t["name"] for t in routing_targets({}, "sampled")][0] == "held-out routing accuracy after stage 2 (first search) (sampled)"


def test_markdown_reports_both_issues_targets_and_the_route_advantages():
    runs = [{"seed": 0, "evaluations": {stage: _routed_stage(0.7, 100.0, 0.5, 0.5) for stage in
                                        ("after SFT", "after stage 1", "after stage 2")}}]
    table = summarise(runs)
    report = {"title": "t", "command": "c", "seconds": 1.0, "seeds": [0], "machine": "m", "recall": {}, "table": table,
              "rl_effect": [], "targets": targets(table), "routing_targets": routing_targets(table) + routing_targets({}, "sampled"),
              "route_advantages": {"direct": {"right_route": "passage", "advantage_right": 0.25, "advantage_other": None,
                                              "steps_right_ahead": 0, "steps_compared": 0}}}
    text = markdown(report)
    assert "## Targets (issue #42" in text and "## Targets (issue #14" in text
    assert "held-out routing accuracy after stage 2 (mode slot) (greedy): 0.500 vs >= 0.9 -> NOT met" in text
    assert "(first search) (sampled): n/a vs >= 0.9 -> NOT met" in text
    assert "| direct | passage | +0.250 | n/a | 0 of 0 |" in text
    assert "| after stage 2 | all | 0.600 [0.600, 0.600] | 0.500 [0.500, 0.500] | – | 0.500 [0.500, 0.500] | 0.500 [0.500, 0.500] |" in text


def test_wall_time_line_adds_each_seeds_own_time_to_the_invocations():
    """A seed trained over several sittings: the last invocation's wall time alone would understate
    the run, so the line also sums each seed report's recorded seconds (by hand: 3,600 + 1,800 s)."""
    report = {"seconds": 120.4, "seed_runs": [{"seconds": {"sft": 600.0, "stage1": 1000.0, "stage2": 2000.0}},
                                              {"seconds": {"sft": 300.0, "stage2": 1500.0}}]}
    assert wall_time_line(report) == ("Wall time of this invocation: 120 s; the seeds' SFT, RL and evaluations: "
                                      "5400 s (1.5 h; per seed [3600, 1800])")
    assert wall_time_line({"seconds": 7.0}) == "Wall time of this invocation: 7 s"


def test_graph_preference_effect_entries_by_hand():
    """With the logit-read preference in the greedy table, rl_effect reports stage 1's change on
    graph_only and stage 2's on direct, tagged as read from logits; without it, neither entry."""
    def stage(pref_graph_only, pref_direct, cost):
        return {kind: {"em": 0.5, "graph_share": 0.5, "graph_preference": pref, "cost_per_question": cost,
                       "searches_per_question": 1.0}
                for kind, pref in (("graph_only", pref_graph_only), ("direct", pref_direct), ("all", 0.0))}

    runs = [{"seed": s, "evaluations": {"after SFT": stage(0.7, 0.6, 10.0), "after stage 1": stage(0.9 + s / 20, 0.8, 100.0),
                                        "after stage 2": stage(0.95, 0.4 - s / 10, 50.0)}} for s in (0, 1)]
    table = summarise(runs)
    assert table["after stage 1"]["graph_only"]["graph_preference"]["per_seed"] == pytest.approx([0.9, 0.95])
    effect = {(e["question_type"], e["metric"]): e for e in rl_effect(table, 2)}
    up = effect[("graph_only", "graph_preference")]
    assert (up["after_sft"], up["after_rl"], up["rl_stage"]) == (0.7, pytest.approx(0.925), "stage 1")
    down = effect[("direct", "graph_preference")]
    assert (down["after_stage1"], down["after_rl"], down["rl_stage"]) == (0.8, pytest.approx(0.35), "stage 2")
    assert up["decoding"] == down["decoding"] == "logits at the mode slot"
    assert effect[("all", "cost_per_question")]["decoding"] == "greedy"
    # sampled tables carry no preference: no such entries
    sampled = summarise([{**r, "sampled_evaluations": {st: {k: {m: v for m, v in kinds[k].items() if m != "graph_preference"}
                                                              for k in kinds} for st, kinds in r["evaluations"].items()}}
                         for r in runs], "sampled_evaluations")
    assert not any(e["metric"] == "graph_preference" for e in rl_effect(sampled, 2, "sampled"))


def test_a_seed_finished_with_the_same_settings_is_read_back(tmp_path):
    from experiments.recipe.routing import SeedSettings, finished_seed, settings_key_of_args
    from experiments.studies.routing import build_parser

    args = build_parser().parse_args(["--seeds", "0"])
    settings = SeedSettings(overrides=("learner.optimizer.lr=1e-5",))
    assert finished_seed(tmp_path, settings, args) is None  # nothing there
    (tmp_path / "seed_report.json").write_text(json.dumps({"seed": 0, "settings": settings_key_of_args(settings, args)}))
    assert finished_seed(tmp_path, settings, args)["seed"] == 0
    written = (tmp_path / "seed_report.json").read_text()
    # a finished seed is never run over: other settings (a repeated override included) or another
    # task is an error naming what differs, and the report stays as it was
    with pytest.raises(ValueError, match=r"stage1_steps.*\(12, 3\)"):
        finished_seed(tmp_path, SeedSettings(stage1_steps=3, overrides=settings.overrides), args)
    with pytest.raises(ValueError, match="overrides"):
        finished_seed(tmp_path, SeedSettings(overrides=settings.overrides * 2), args)
    with pytest.raises(ValueError, match=r"heldout.*\(64, 10\)"):
        finished_seed(tmp_path, settings, build_parser().parse_args(["--heldout", "10"]))
    assert (tmp_path / "seed_report.json").read_text() == written
    # a report written before a setting existed is read with that setting at its default
    older = {k: v for k, v in settings_key_of_args(settings, args).items() if k != "sft_retry_share"}
    (tmp_path / "seed_report.json").write_text(json.dumps({"seed": 0, "settings": older}))
    assert finished_seed(tmp_path, settings, args)["seed"] == 0
    with pytest.raises(ValueError, match=r"sft_retry_share.*\(0.0, 0.5\)"):
        finished_seed(tmp_path, SeedSettings(sft_retry_share=0.5, overrides=settings.overrides), args)
    (tmp_path / "seed_report.json").write_text("{not json")
    with pytest.raises(ValueError, match="seed_report.json: not a readable seed report"):
        finished_seed(tmp_path, settings, args)


def test_seed_progress_reads_an_older_key_with_new_settings_at_their_default(tmp_path):
    from experiments.recipe.routing import SeedProgress, SeedSettings, seed_settings_key

    key = seed_settings_key(SeedSettings(stage1_steps=5), {"heldout": 48})
    older = {k: v for k, v in key.items() if k != "max_response_tokens"}
    (tmp_path / "progress.json").write_text(json.dumps({"settings": older, "sft": {"steps": 3}, "evaluations": {},
                                                         "sampled_evaluations": {}, "results": {}, "seconds": {}}))
    assert SeedProgress(tmp_path, key).state["sft"] == {"steps": 3}
    longer = seed_settings_key(SeedSettings(stage1_steps=5, max_response_tokens=144), {"heldout": 48})
    with pytest.raises(ValueError, match=r"max_response_tokens.*\(96, 144\)"):
        SeedProgress(tmp_path, longer)


def test_sft_from_reuses_an_earlier_seeds_sft_only_with_the_same_settings(tmp_path):
    from experiments.recipe.routing import SeedSettings, reused_sft, settings_key_of_args
    from experiments.studies.routing import build_parser

    args = build_parser().parse_args(["--seeds", "0", "--sft-from", str(tmp_path)])
    assert args.sft_from == str(tmp_path)
    earlier, seed_dir = SeedSettings(sft_examples=48), tmp_path / "seed0"
    with pytest.raises(ValueError, match="seed_report.json"):  # nothing there
        reused_sft(seed_dir, earlier, {})
    (seed_dir / "sft" / "policy").mkdir(parents=True)
    (seed_dir / "seed_report.json").write_text(json.dumps({"settings": settings_key_of_args(earlier, args)}))
    (seed_dir / "sft" / "sft_summary.json").write_text(json.dumps({"examples": 96, "steps": 24, "loss_first": 2.4,
                                                                   "loss_last": 0.2, "policy_dir": "/elsewhere"}))
    task = {"world_seed": args.world_seed, "entities": args.entities, "questions": args.questions, "heldout": args.heldout}
    with pytest.raises(ValueError, match="no saved policy"):
        reused_sft(seed_dir, earlier, task)
    (seed_dir / "sft" / "policy" / "config.json").write_text("{}")
    # RL settings may differ: that is what reusing one SFT policy is for
    now = SeedSettings(sft_examples=48, stage1_steps=3, overrides=("rollout.temperature=0.7",), sft_from=str(tmp_path))
    sft = reused_sft(seed_dir, now, task)
    assert sft["steps"] == 24 and sft["policy_dir"] == str((seed_dir / "sft" / "policy").resolve())
    with pytest.raises(ValueError, match="sft_lr"):  # another SFT
        reused_sft(seed_dir, SeedSettings(sft_examples=48, sft_lr=1e-4), task)
    with pytest.raises(ValueError, match="heldout"):  # another task
        reused_sft(seed_dir, now, {**task, "heldout": 10})
    # a report written before sft_retry_share existed trained without retries, as the default does
    settings = json.loads((seed_dir / "seed_report.json").read_text())["settings"]
    del settings["sft_retry_share"]
    (seed_dir / "seed_report.json").write_text(json.dumps({"settings": settings}))
    assert reused_sft(seed_dir, now, task)["steps"] == 24
    with pytest.raises(ValueError, match="sft_retry_share"):
        reused_sft(seed_dir, SeedSettings(sft_examples=48, sft_retry_share=0.5), task)
    # a seed stopped after its SFT has no report; its progress.json says which settings trained it
    (seed_dir / "seed_report.json").unlink()
    progress = seed_dir / "progress.json"
    progress.write_text(json.dumps({"settings": settings_key_of_args(earlier, args), "sft": None}))
    with pytest.raises(ValueError, match=r"progress.json.*stopped before its SFT was done"):
        reused_sft(seed_dir, now, task)
    progress.write_text(json.dumps({"settings": settings_key_of_args(earlier, args), "sft": {"steps": 24}}))
    assert reused_sft(seed_dir, now, task)["steps"] == 24
    with pytest.raises(ValueError, match=r"progress.json trained SFT with other settings.*sft_lr"):
        reused_sft(seed_dir, SeedSettings(sft_examples=48, sft_lr=1e-4), task)


def test_retry_and_response_budget_flags():
    from experiments.recipe.routing import SeedSettings
    from experiments.studies.routing import build_parser

    args = build_parser().parse_args(["--sft-retry-share", "0.5", "--max-response-tokens", "144"])
    assert (args.sft_retry_share, args.max_response_tokens) == (0.5, 144)
    # the defaults keep what make demo and the slow test ran before: no retries, the config's 96 tokens
    assert (SeedSettings().sft_retry_share, SeedSettings().max_response_tokens) == (0.0, 96)


def test_sft_modes_weight_the_draw_and_reject_typos(world):
    from experiments.recipe.routing import sft_modes

    assert sft_modes("passage, passage,graph") == ("passage", "passage", "graph")
    for bad in ("", "passage,grpah", "text"):
        with pytest.raises(ValueError, match="--sft-modes"):
            sft_modes(bad)
    # a mode listed three times out of four is drawn for about three searches in four
    steps = [step["mode"] for q in with_search_modes(world.questions, sft_modes("passage,passage,passage,graph"), seed=3)
             for step in q.golden_trajectory]
    share = steps.count("graph") / len(steps)
    assert len(steps) >= 100 and 0.12 < share < 0.38


def test_sft_order_and_schedule_flags(capsys):
    import random

    from experiments.recipe.routing import SFT_ORDERS, SeedSettings, graph_searches
    from experiments.studies.routing import build_parser

    args = build_parser().parse_args(["--sft-order", "per-question", "--sft-lr-schedule", "linear",
                                      "--sft-mode-sampling", "every"])
    assert (args.sft_order, args.sft_lr_schedule, args.sft_mode_sampling) == ("per-question", "linear", "every")
    defaults = SeedSettings()
    assert (defaults.sft_order, defaults.sft_lr_schedule, defaults.sft_mode_sampling) == ("shuffled", "constant", "draw")
    for bad in (["--sft-order", "sorted"], ["--sft-lr-schedule", "cosine"], ["--sft-mode-sampling", "all"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
        assert "invalid choice" in capsys.readouterr().err
    assert SFT_ORDERS["shuffled"] is None
    examples = [{"question_id": q, "modes": m} for q, m in
                [("a", ["passage"]), ("b", ["passage"]), ("a", ["graph"]), ("b", ["graph"])]]
    order = SFT_ORDERS["per-question"](examples, random.Random(0))
    assert order in ([0, 2, 1, 3], [1, 3, 0, 2])
    order = SFT_ORDERS["mode-balanced"](examples, random.Random(0))
    assert sorted(graph_searches(examples[i]) for i in order[:2]) == [0, 1]
    assert graph_searches({"modes": ["graph", "passage", "graph"]}) == 2 and graph_searches({"modes": []}) == 0
