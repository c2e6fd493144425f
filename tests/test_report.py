"""The demo report: mode-mix counting, stage comparison, and the files it writes."""

from __future__ import annotations

import json

import pytest

from experiments.eval.report import comparison_rows, mode_mix, mode_mix_by_step, read_jsonl, write_report


def test_mode_mix_counts_searches_not_episodes():
    # 3 passage, 1 graph, 0 hybrid searches over three episodes (one never searched).
    mix = mode_mix([{"modes": ["passage", "passage"]}, {"modes": ["graph", "passage"]}, {"modes": []}])
    assert mix == {"passage": 0.75, "graph": 0.25, "hybrid": 0.0, "searches": 4}
    assert mode_mix([{"modes": []}, {}]) == {"passage": 0.0, "graph": 0.0, "hybrid": 0.0, "searches": 0}


def _eval(em, f1, turns):
    return {"datasets": {"heldout": {"agent": {"em": em, "f1": f1, "retrieval_turns": turns,
                                               "mode_mix": {"passage": 1.0, "graph": 0.0, "hybrid": 0.0}}}}}


def test_comparison_rows_carry_every_stage_and_the_change():
    rows = comparison_rows([("untrained", _eval(0.0, 0.1, 0.0)), ("sft", _eval(0.25, 0.4, 1.0)), ("grpo", _eval(0.5, 0.6, 1.5))])
    assert len(rows) == 1
    row = rows[0]
    assert row["em"] == {"untrained": 0.0, "sft": 0.25, "grpo": 0.5, "delta": 0.5}
    assert row["f1"]["delta"] == pytest.approx(0.5)
    assert row["retrieval_turns"]["delta"] == 1.5
    assert row["eo"]["delta"] is None  # missing metric: no invented number


def test_write_report_writes_markdown_json_and_plots(tmp_path):
    traj = tmp_path / "run" / "trajectories"
    traj.mkdir(parents=True)
    for step, modes in ((1, ["passage", "graph"]), (2, ["hybrid", "hybrid"])):
        with (traj / f"step-{step:06d}.jsonl").open("w") as fh:
            fh.write(json.dumps({"episode": {"modes": modes}}) + "\n")
    metrics = [{"step": 1, "stage": 1, "reward_mean": 0.1, "em": 0.0, "retrievals_mean": 1.0},
               {"step": 2, "stage": 2, "reward_mean": 0.3, "em": 0.5, "retrievals_mean": 2.0}]
    report = write_report(tmp_path / "out", evaluations=[("untrained", _eval(0.0, 0.1, 0.0)), ("grpo", _eval(0.5, 0.6, 1.5))],
                          train_metrics=metrics, trajectory_dir=traj, meta={"title": "t", "policy": "p"})
    assert [r["step"] for r in report["mode_mix_by_step"]] == [1, 2]
    assert report["mode_mix_by_step"][1]["hybrid"] == 1.0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| heldout | agent | 0.000 | 0.500 | 0.500 |" in md  # EM table: untrained, grpo, change
    assert json.loads((tmp_path / "out" / "report.json").read_text())["stages"] == ["untrained", "grpo"]
    for name in ("reward", "em", "retrieval_turns", "mode_mix"):
        png = tmp_path / "out" / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "out").rglob(".*tmp*"))


def test_read_jsonl_names_the_bad_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"m.jsonl: line 2"):
        read_jsonl(path)
    assert mode_mix_by_step(tmp_path / "missing") == []
