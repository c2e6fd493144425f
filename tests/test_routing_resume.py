"""A routing seed split over sittings (``experiments.studies.routing``, issue #42): each sitting
stops once its time is up, after at least one part or RL step, and the next one goes on from what
the last saved, redoing nothing. Real parts throughout: SFT, the vLLM engine on Ray, the learner,
checkpoints. A small world and a few tiny steps keep it to a few minutes."""

from __future__ import annotations

import json
import time

import pytest
import ray

from experiments.eval.report import read_jsonl
from experiments.recipe.routing import (EVAL_KWARGS, SeedProgress, SeedSettings, SeedStopped, build_task, run_seed,
                                        seed_settings_key)

# `make test-slow`, not CI: docs/development.md says which CI tests catch what this one would.
pytestmark = pytest.mark.slow

SETTINGS = SeedSettings(sft_examples=8, sft_epochs=1, sft_batch=8, stage1_steps=2, stage2_steps=1, prompts_per_step=2,
                        group_size=2, eval_samples=0, max_response_tokens=64,
                        overrides=("rollout.workers=1", "rollout.env_runners=1", "num_learners=1"))
TASK_KEY = {"world_seed": 0, "entities": 120, "questions": 60, "heldout": 6}


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _sitting(task, out, stop_at):
    try:
        return run_seed(task, 0, out, SETTINGS, {**EVAL_KWARGS, "show_progress": False}, show_progress=False,
                        task_key=TASK_KEY, resumable=True, stop_at=stop_at)
    except SeedStopped as stopped:
        return str(stopped)


def test_a_seed_goes_on_from_where_the_last_sitting_stopped(tmp_path, ray_session):
    task = build_task(tmp_path, seed=0, entities=TASK_KEY["entities"], questions=TASK_KEY["questions"],
                      heldout=TASK_KEY["heldout"], show_progress=False)
    out = tmp_path / "seed0"
    progress = lambda: json.loads((out / "progress.json").read_text())  # noqa: E731

    # 1. time is up from the start: the sitting trains SFT, saves it and stops before the RL runtime starts
    assert _sitting(task, out, time.time()) == "seed 0 stopped before the evaluations and RL"
    sft_summary = out / "sft" / "sft_summary.json"
    sft_written = sft_summary.stat().st_mtime_ns
    assert progress()["sft"]["policy_dir"] and progress()["evaluations"] == {}

    # 2. the SFT is read back, not trained again; the evaluation after it is the part this sitting finishes
    assert _sitting(task, out, time.time()) == "seed 0 stopped before stage 1"
    assert sft_summary.stat().st_mtime_ns == sft_written
    assert list(progress()["evaluations"]) == ["after SFT"]
    sft_episodes = out / "eval" / "sft" / "trajectories" / "routing-heldout__agent.jsonl"
    sft_evaluated = sft_episodes.stat().st_mtime_ns

    # 3. stage 1 stops after its first step, with a checkpoint there
    assert _sitting(task, out, time.time()) == "seed 0 stopped in stage 1, after step 1"
    assert [m["step"] for m in read_jsonl(out / "grpo" / "metrics.jsonl")] == [1]
    assert (out / "grpo" / "checkpoints" / "step-000001").is_dir()

    # 4. no time limit: stage 1's second step from that checkpoint, its evaluation, stage 2, its evaluation
    report = _sitting(task, out, None)
    assert isinstance(report, dict), report
    assert list(report["evaluations"]) == ["after SFT", "after stage 1", "after stage 2"]
    steps = read_jsonl(out / "grpo" / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2, 3]  # every step once: none redone, none skipped
    assert [m["stage"] for m in steps] == ["stage1", "stage1", "stage2"]
    assert sft_summary.stat().st_mtime_ns == sft_written
    assert sft_episodes.stat().st_mtime_ns == sft_evaluated
    assert report["sft"]["steps"] == progress()["sft"]["steps"]
    assert report["evaluations"] == progress()["evaluations"]
    # each evaluation reads the routing both ways: from the episodes' first search per type, and
    # from the mode slot's logits on the probes (here every held-out question is a probe, so a
    # share of the 6)
    for evaluation in report["evaluations"].values():
        assert {"route_accuracy", "routing_accuracy"} <= set(evaluation["all"]), evaluation["all"]
        right = len(task.heldout) * evaluation["all"]["routing_accuracy"]
        assert right == pytest.approx(round(right)), evaluation["all"]
    # and the curves carry each step's advantage by the route of the first search, per type
    assert {"advantage/graph/graph_only", "advantage/passage/direct"} <= set(report["curves"][-1])

    # a folder started with other settings is refused, naming what differs, and nothing is touched
    with pytest.raises(ValueError, match="stage2_steps"):
        SeedProgress(out, seed_settings_key(SeedSettings(**{**vars(SETTINGS), "stage2_steps": 5}), TASK_KEY))
    assert report["evaluations"] == progress()["evaluations"]
