"""Issue #64's stage-2 snapshots and EM-only control in the routing study
(``experiments.studies.routing``): the control's config, the snapshot schedule and its resume
bookkeeping, the fork of stage 1's checkpoint, and a seed's whole order of parts, run with a fake
trainer and evaluator (no model, engine or Ray: each "policy" is the list of steps that trained it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import experiments.train
from experiments.recipe.config import load_config
from experiments.eval.report import read_jsonl
from experiments.recipe import routing
from experiments.recipe.routing import (RL_CONFIG, RoutingTask, SeedSettings, SeedStopped, control_overrides,
                                        fork_checkpoint, pending_snapshots, run_seed, runtime_differs, seed_snapshots,
                                        snapshot_steps, stage_configs)
from experiments.studies.routing import build_parser, show_progress
from experiments.recipe.training import CHECKPOINT_MARKER, latest_checkpoint, reward_schedule

# ----------------------------------------------------------------------------- the control's config

STAGE2 = ("data.balance_by=kind", "learner.loss.mode_pg_coef=2.0", "learner.loss.mode_entropy_coef=0.1",
          "reward.temperature=2.0")


def test_the_control_is_stage_2_with_em_only_and_its_own_folder(tmp_path):
    s = SeedSettings(stage1_steps=20, stage2_steps=12, stage2_overrides=STAGE2, em_only_control=True)
    base = [f"run.out_dir={tmp_path / 'grpo'}", "reward.stage2_start=20", "learner.loss.mode_entropy_coef=1.0"]
    stages = stage_configs(base, s, tmp_path / "control")
    two, control = stages["stage 2"], stages["control"]
    assert list(stages) == ["stage 1", "stage 2", "control"]
    assert control.run.out_dir == str(tmp_path / "control") and two.run.out_dir == str(tmp_path / "grpo")
    assert control.run.steps == two.run.steps == 32 and control.run.resume
    # the same trainer options as stage 2 ...
    assert control.data.balance_by == "kind" and control.learner.loss.mode_pg_coef == 2.0
    assert control.learner.loss.mode_entropy_coef == 0.1
    assert runtime_differs(two, control) == []  # ... so stage 2's runtime trains it
    # ... but the reward: RouteRAG's stage 1 (EM) at every step, the efficiency overrides left out
    assert two.reward.temperature == 2.0 and "temperature" not in control.reward
    assert control.reward.stage2_start == 32
    assert {reward_schedule(control).stage_at(step) for step in range(32)} == {"stage1"}
    assert reward_schedule(two).stage_at(19) == "stage1" and reward_schedule(two).stage_at(20) == "stage2"
    # without the control flag there is no control stage
    assert list(stage_configs(base, s)) == ["stage 1", "stage 2"]
    overrides = control_overrides(base, s, tmp_path / "control")
    assert [o for o in overrides if o.startswith("reward.")] == ["reward.stage2_start=20", "reward.stage2_start=32"]


def test_the_flags_and_their_defaults():
    args = build_parser().parse_args([])
    assert (args.snapshot_every, args.em_only_control, args.probes_per_type) == (0, False, 16)
    args = build_parser().parse_args(["--snapshot-every", "2", "--em-only-control", "--probes-per-type", "48"])
    assert (args.snapshot_every, args.em_only_control, args.probes_per_type) == (2, True, 48)
    s = SeedSettings()  # the demo's seeds: every new option off
    assert (s.snapshot_every, s.em_only_control, s.probes_per_type) == (0, False, 16)


# ----------------------------------------------------------------------------- snapshot schedule


def test_the_snapshot_schedule_by_hand():
    assert snapshot_steps(12, 2) == [2, 4, 6, 8, 10, 12]
    assert snapshot_steps(12, 5) == [5, 10, 12]  # the stage's last step always: its own evaluation
    assert snapshot_steps(3, 5) == [3]
    assert snapshot_steps(12, 0) == [] and snapshot_steps(0, 2) == []
    with pytest.raises(ValueError):
        snapshot_steps(12, -1)
    # the last is never pending: the stage-end evaluation takes it
    assert pending_snapshots([2, 4, 6], {}) == [2, 4]
    assert pending_snapshots([2, 4, 6], {"2": {}}) == [4]
    assert pending_snapshots([2, 4, 6], {"2": {}, "4": {}}) == []
    assert pending_snapshots([], {}) == []


@settings(max_examples=100, deadline=None)
@given(steps=st.integers(1, 60), every=st.integers(1, 20))
def test_the_schedule_takes_every_multiple_and_ends_at_the_last_step(steps, every):
    schedule = snapshot_steps(steps, every)
    assert schedule == sorted(set(schedule)) and schedule[-1] == steps and schedule[0] >= 1
    assert set(schedule) - {steps} == set(range(every, steps, every))


def test_seed_snapshots_reads_progress_and_the_stage_end_evaluation():
    progress = {"snapshots": {"stage 2": {"4": "e4", "2": "e2"}, "control": {"2": "c2"}},
                "evaluations": {"after stage 2": "e6"}}
    assert seed_snapshots(progress, [2, 4, 6], 20) == {
        "stage 2": [{"step": 2, "run_step": 22, "evaluation": "e2"}, {"step": 4, "run_step": 24, "evaluation": "e4"},
                    {"step": 6, "run_step": 26, "evaluation": "e6"}],
        "control": [{"step": 2, "run_step": 22, "evaluation": "c2"}]}
    assert seed_snapshots({"evaluations": {}}, [], 20) == {}


# ----------------------------------------------------------------------------- the fork


def _checkpoint(run_dir: Path, step: int, state: dict) -> Path:
    path = run_dir / "checkpoints" / f"step-{step:06d}"
    (path / "policy").mkdir(parents=True)
    (path / "policy" / "weights.bin").write_text(json.dumps(state))
    (path / CHECKPOINT_MARKER).write_text(json.dumps({"step": step, **state}))
    return path


def test_the_control_starts_from_a_copy_of_stage_1s_checkpoint(tmp_path):
    source = _checkpoint(tmp_path / "grpo", 20, {"history": "stage 1"})
    forked = fork_checkpoint(tmp_path / "grpo", tmp_path / "control", 20)
    assert forked == tmp_path / "control" / "checkpoints" / "step-000020"
    assert latest_checkpoint(tmp_path / "control") == forked
    assert (forked / "policy" / "weights.bin").read_text() == (source / "policy" / "weights.bin").read_text()
    assert [p.name for p in (tmp_path / "control" / "checkpoints").iterdir()] == ["step-000020"]  # no staging left
    # once the branch has a checkpoint of its own, a later sitting keeps it (stage 1's is pruned by then)
    _checkpoint(tmp_path / "control", 22, {"history": "control"})
    (source / CHECKPOINT_MARKER).unlink()
    assert fork_checkpoint(tmp_path / "grpo", tmp_path / "control", 20) == tmp_path / "control" / "checkpoints" / "step-000022"
    with pytest.raises(ValueError, match="no committed checkpoint"):
        fork_checkpoint(tmp_path / "grpo", tmp_path / "other", 20)


# ----------------------------------------------------------------------------- a seed's parts, faked

S1, S2, EVERY = 4, 6, 2
FAKE = SeedSettings(stage1_steps=S1, stage2_steps=S2, snapshot_every=EVERY, em_only_control=True, eval_samples=0,
                    stage2_overrides=("learner.loss.mode_entropy_coef=0.1",))


class FakeRuntime:
    """Stands for the engines: ``weights`` is the list of steps the policy it holds was trained by."""

    def __init__(self, cfg):
        self.cfg, self.weights = cfg, []

    def shutdown(self):
        pass


class Fakes:
    """A trainer that records each step as ``[run step, reward stage, run folder]`` in its
    checkpoints (one kept, as routing_grpo.yaml does) and its engines; an evaluator whose figures
    are that list."""

    def __init__(self):
        self.train_calls, self.evaluations, self.preferences = [], [], []

    def train(self, cfg, runtime=None, stop_at=None):
        out, steps = Path(cfg.run.out_dir), int(cfg.run.steps)
        checkpoint = latest_checkpoint(out) if (out / "checkpoints").is_dir() else None
        history = json.loads((checkpoint / CHECKPOINT_MARKER).read_text())["history"] if checkpoint else []
        schedule = reward_schedule(cfg)
        out.mkdir(parents=True, exist_ok=True)
        runtime.weights = list(history)
        self.train_calls.append((out.name, len(history), steps))
        last = {}
        for step in range(len(history), steps):
            history.append([step + 1, schedule.stage_at(step), out.name])
            with (out / "metrics.jsonl").open("a") as fh:
                fh.write(json.dumps({"step": step + 1, "stage": schedule.stage_at(step), "em": 0.5}) + "\n")
            for old in (out / "checkpoints").glob("step-*") if (out / "checkpoints").is_dir() else []:
                for f in sorted(old.rglob("*"), reverse=True):
                    f.rmdir() if f.is_dir() else f.unlink()
                old.rmdir()
            _checkpoint(out, step + 1, {"history": history})
            runtime.weights, last = list(history), {"step": step + 1}
            if stop_at is not None and time.time() >= stop_at and step + 1 < steps:
                return {**last, "stopped_early": True}
        return last

    def evaluate_policy(self, policy_dir, task, out, eval_kwargs, samples=1, runtime=None):
        self.evaluations.append(out.name)
        weights = list(runtime.weights)
        per_type = {"n": 1, "em": len(weights) / 100, "graph_share": 0.5, "searches_per_question": 1.0,
                    "cost_per_question": 1000.0 * len(weights)}
        return {"all": {**per_type, "weights": weights}, "graph_only": dict(per_type), "direct": dict(per_type)}, {}

    def preference_by_type(self, policy, tokenizer, probes):
        self.preferences.append(str(policy))
        return {"graph_only": [0.9], "direct": [0.2]}


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    fake = Fakes()
    monkeypatch.setattr(experiments.train, "train", fake.train)
    monkeypatch.setattr(experiments.train, "open_runtime", FakeRuntime)
    monkeypatch.setattr(routing, "evaluate_policy", fake.evaluate_policy)
    monkeypatch.setattr(routing, "preference_by_type", fake.preference_by_type)
    monkeypatch.setattr(routing.Retriever, "load", staticmethod(lambda *a, **k: None))
    monkeypatch.setattr(routing, "load_policy_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr(routing, "mode_probes", lambda *a, **k: {})
    monkeypatch.setattr(routing, "format_only_sft", lambda *a, **k: {"policy_dir": str(tmp_path / "sft"), "examples": 1,
                                                                     "steps": 1, "loss_first": 1.0, "loss_last": 0.5})
    return fake


def _seed(tmp_path, stop_at):
    task = RoutingTask(tmp_path / "world", tmp_path / "index", [], [], None, {})
    return run_seed(task, 2, tmp_path / "seed2", FAKE, {**routing.EVAL_KWARGS}, show_progress=False,
                    task_key={"world_seed": 0}, resumable=True, stop_at=stop_at)


def _expected_weights(branch: str, run_step: int) -> list:
    stage1 = [[n, "stage1", "grpo"] for n in range(1, S1 + 1)]
    if branch == "stage 2":
        return stage1 + [[n, "stage2", "grpo"] for n in range(S1 + 1, run_step + 1)]
    return stage1 + [[n, "stage1", "control"] for n in range(S1 + 1, run_step + 1)]  # EM only throughout


def _check_report(run: dict, fake: Fakes, tmp_path: Path) -> None:
    schedule = [2, 4, 6]
    assert list(run["snapshots"]) == ["stage 2", "control"]
    for branch, snaps in run["snapshots"].items():
        assert [snap["step"] for snap in snaps] == schedule and [snap["run_step"] for snap in snaps] == [6, 8, 10]
        for snap in snaps:  # each snapshot evaluated the policy of its own step, on its own branch
            assert snap["evaluation"]["all"]["weights"] == _expected_weights(branch, snap["run_step"]), (branch, snap["step"])
            assert snap["evaluation"]["graph_only"]["routing_accuracy"] == 1.0
    assert list(run["evaluations"]) == ["after SFT", "after stage 1", "after stage 2", "after control"]
    # the snapshots before a branch's end read the mode slot from that step's checkpoint
    for name, step in (("grpo", 6), ("grpo", 8), ("control", 6), ("control", 8)):
        assert str(tmp_path / "seed2" / name / "checkpoints" / f"step-{step:06d}") in fake.preferences
    # every snapshot and stage evaluated once, over however many sittings
    assert sorted(fake.evaluations) == sorted(["sft", "stage1", "stage2_step002", "stage2_step004", "stage2",
                                               "control_step002", "control_step004", "control"])
    for name in ("grpo", "control"):  # every step trained once: none redone, none skipped
        steps = [m["step"] for m in read_jsonl(tmp_path / "seed2" / name / "metrics.jsonl")]
        assert steps == list(range(1 if name == "grpo" else S1 + 1, S1 + S2 + 1))
    assert [m["stage"] for m in run["control_train_metrics"]] == ["stage1"] * S2


def test_a_seed_takes_each_snapshot_on_both_branches_in_one_sitting(tmp_path, fakes):
    run = _seed(tmp_path, None)
    _check_report(run, fakes, tmp_path)
    # stage 2 and the control each train in pieces up to their snapshots, then to their end
    assert [(name, steps) for name, _, steps in fakes.train_calls] == [
        ("grpo", 4), ("grpo", 6), ("grpo", 8), ("grpo", 10), ("control", 6), ("control", 8), ("control", 10)]
    progress = json.loads((tmp_path / "seed2" / "progress.json").read_text())
    assert sorted(progress["snapshots"]["stage 2"]) == ["2", "4"] and sorted(progress["snapshots"]["control"]) == ["2", "4"]


def test_a_seed_split_over_sittings_redoes_no_snapshot(tmp_path, fakes):
    messages = []
    for _ in range(60):  # every sitting's time is up at once: it finishes one part or step, then stops
        try:
            run = _seed(tmp_path, time.time())
            break
        except SeedStopped as stopped:
            messages.append(str(stopped))
    else:
        pytest.fail(f"no end after {len(messages)} sittings: {messages[-5:]}")
    _check_report(run, fakes, tmp_path)
    assert "seed 2 stopped before the stage 2 snapshot after stage-2 step 2" in messages
    assert "seed 2 stopped in control, after step 5" in messages
    assert len(messages) > 2 * S2  # a sitting per RL step at least: the pieces did resume


def test_show_progress_prints_the_snapshots_so_far_and_of_a_finished_seed(tmp_path, fakes, capsys):
    run = _seed(tmp_path, None)
    args = build_parser().parse_args(["--out", str(tmp_path), "--seeds", "2", "--stage1-steps", str(S1), "--stage2-steps",
                                      str(S2), "--snapshot-every", str(EVERY), "--entities", "120", "--questions", "60",
                                      "--show-progress"])
    capsys.readouterr()
    assert show_progress(args) == 0  # still training: read from progress.json and the run folders
    text = capsys.readouterr().out
    assert "seed 2, EM-only control" in text and "seed 2, snapshots (greedy, held-out):" in text
    # snapshot figures: EM = trained steps / 100, cost = 1,000 per trained step (the fake evaluator's)
    assert "| 2 | stage 2 | 2 | 1.000 | 1.000 | +0.700 | 0.060 | 0.060 | 6,000 |" in text
    assert "| 2 | control | 6 | 1.000 | 1.000 | +0.700 | 0.100 | 0.100 | 10,000 |" in text
    (tmp_path / "seed2" / "seed_report.json").write_text(json.dumps(run))
    assert show_progress(args) == 0  # finished: read from its seed report
    assert capsys.readouterr().out.count("| 2 | control |") == 3


def test_with_the_options_off_a_seed_runs_as_before(tmp_path, fakes):
    task = RoutingTask(tmp_path / "world", tmp_path / "index", [], [], None, {})
    plain = SeedSettings(stage1_steps=S1, stage2_steps=S2, eval_samples=0)  # the demo's kind of seed
    run = run_seed(task, 2, tmp_path / "seed2", plain, {**routing.EVAL_KWARGS}, show_progress=False)
    assert [(name, steps) for name, _, steps in fakes.train_calls] == [("grpo", S1), ("grpo", S1 + S2)]
    assert sorted(fakes.evaluations) == ["sft", "stage1", "stage2"]
    assert set(run) == {"seed", "evaluations", "sampled_evaluations", "results", "curves", "train_metrics",
                        "rollout_engine", "sft", "seconds"}
    assert not (tmp_path / "seed2" / "control").exists()
