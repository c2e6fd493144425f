"""The rollout-precision study's report (issue #68): what it reads from each run's files, by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.studies.rollout_precision import (BASELINE, STAGE1_STEPS, VARIANTS, main, markdown, study_command,
                                                   summary)

KINDS = {"q-graph": "graph_only", "q-direct": "direct"}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _fake_run(out: Path, variant: str, seed: int, em_after_stage1: float, rollout_seconds: float) -> None:
    """A run's files as the routing study writes them: 2 episodes a step, one per type."""
    seed_dir = out / variant / f"seed{seed}"
    _write_jsonl(out / variant / "world" / "train_questions.jsonl", [{"id": q, "kind": k} for q, k in KINDS.items()])
    evaluation = {kind: {"em": 0.5, "graph_share": 0.5, "graph_preference": 0.5} for kind in KINDS.values()}
    after = {kind: dict(v) for kind, v in evaluation.items()}
    after["graph_only"]["em"] = em_after_stage1
    report = {"evaluations": {"after SFT": evaluation, "after stage 1": after}, "seconds": {"stage1": 100.0 + seed}}
    seed_dir.mkdir(parents=True, exist_ok=True)
    (seed_dir / "seed_report.json").write_text(json.dumps(report), encoding="utf-8")
    metrics = []
    for step in range(1, STAGE1_STEPS + 1):
        # the graph_only episode is right from step 3 on and searches the graph; 3 + 5 model tokens
        _write_jsonl(seed_dir / "grpo" / "trajectories" / f"step-{step:06d}.jsonl", [
            {"loss_mask": [0, 1, 1, 1], "reward": float(step >= 3),
             "episode": {"question_id": "q-graph", "modes": ["graph"] if step >= 2 else ["passage"]}},
            {"loss_mask": [0, 0, 1, 1, 1, 1, 1], "reward": 1.0, "episode": {"question_id": "q-direct", "modes": ["passage"]}}])
        metrics.append({"step": step, "time/rollout": rollout_seconds, "time/learn": 10.0,
                        "learner/rollout_is/kl_k3": 0.01 * step,
                        **({"learner/rollout_is/changed_share": 0.1} if variant == "bf16_tis" else {})})
    _write_jsonl(seed_dir / "grpo" / "metrics.jsonl", metrics)


def test_the_report_reads_each_runs_files_and_the_target(tmp_path):
    ems = {"fp32": (0.6, 0.8), "bf16": (0.5, 0.55), "bf16_tis": (0.7, 0.75)}
    for variant, per_seed in ems.items():
        for seed, em in enumerate(per_seed):
            _fake_run(tmp_path, variant, seed, em, rollout_seconds=4.0 if variant == "fp32" else 2.0)
    s = summary(tmp_path, [0, 1])
    step3 = s["runs"]["fp32"][0]["steps"][2]
    assert (step3["em/graph_only"], step3["graph_share/graph_only"], step3["em/direct"]) == (1.0, 1.0, 1.0)
    assert s["runs"]["fp32"][0]["steps"][0]["graph_share/graph_only"] == 0.0
    assert step3["rollout_tokens_per_s"] == pytest.approx(8 / 4.0)  # trained tokens / rollout seconds
    assert s["rollout_speed_vs_fp32"] == pytest.approx({"fp32": 1.0, "bf16": 2.0, "bf16_tis": 2.0})
    targets = {t["variant"]: t for t in s["targets"]}
    assert targets["bf16_tis"]["met"] and targets["bf16_tis"]["fp32_range"] == [0.6, 0.8]
    assert targets["bf16_tis"]["graph_only_em_after_stage1"] == pytest.approx(0.725)
    assert not targets["bf16"]["met"]  # mean 0.525 < 0.6
    assert targets["bf16"]["paired_difference_per_seed"] == pytest.approx([-0.1, -0.25])
    assert s["headline"]["fp32"]["stage 1 steps: kl_k3"] == pytest.approx({"mean": 0.03, "max": 0.05})
    assert "stage 1 steps: changed_share" in s["headline"]["bf16_tis"]
    assert "stage 1 steps: changed_share" not in s["headline"]["fp32"]
    assert "NOT within" in markdown(s) and "bf16_tis 2.000x" in markdown(s)


def test_missing_runs_are_named_and_nothing_is_written(tmp_path, capsys):
    _fake_run(tmp_path, BASELINE, 0, 0.6, 4.0)
    assert main(["--out", str(tmp_path), "--seeds", "0"]) == 2
    assert "bf16/seed0/seed_report.json" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


def test_the_bf16_variants_start_from_the_baselines_sft(tmp_path):
    assert "--sft-from" not in study_command(tmp_path, BASELINE, 1)
    cmd = study_command(tmp_path, "bf16_tis", 1)
    assert cmd[cmd.index("--sft-from") + 1] == str(tmp_path / BASELINE)
    assert "rollout.dtype=bfloat16" in cmd and "learner.old_logprobs=recompute" in cmd
    assert set(VARIANTS) == {"fp32", "bf16", "bf16_tis"}
