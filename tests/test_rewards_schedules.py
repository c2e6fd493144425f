"""Stage / phase schedules: step → reward function, and config validation."""

import numpy as np
import pytest

from raggym.rewards import (
    EpisodeOutcome,
    StageSchedule,
    graphrag_r1_schedule,
    lws_schedule,
    reward_schedule_from_config,
    routerag_schedule,
)


def _batch():
    return [
        EpisodeOutcome(answer="Paris", gold_answers=("Paris",), queries=("capital",), retrieval_seconds=0.0),
        EpisodeOutcome(answer="Paris", gold_answers=("Paris",), queries=("a", "b"), retrieval_seconds=10.0),
        EpisodeOutcome(answer="Lyon", gold_answers=("Paris",), queries=("c", "d"), retrieval_seconds=20.0),
    ]


def test_stage_schedule_boundaries():
    s = StageSchedule(("one", "two", "three"), (0, 5, 9))
    assert [s.stage_at(i) for i in (0, 4, 5, 8, 9, 100)] == ["one", "one", "two", "two", "three", "three"]
    with pytest.raises(ValueError):
        StageSchedule(("a", "b"), (1, 2))
    with pytest.raises(ValueError):
        StageSchedule(("a", "b"), (0, -1))


def test_routerag_switches_at_configured_step():
    sched = routerag_schedule(stage2_start=20)
    assert sched.stage_at(19) == "stage1" and sched.stage_at(20) == "stage2"
    assert sched(0)(_batch()) == [1.0, 1.0, 0.0]
    # stage 2: times [0, 10, 20]; p95 = 19; scaled [0, 5/19, 0.5]; mean (5/19 + 0.5)/3
    scaled = np.array([0.0, 5 / 19, 0.5])
    expected = [1 + scaled.mean() - scaled[0], 1 + scaled.mean() - scaled[1], 0.0]
    np.testing.assert_allclose(sched(20)(_batch()), expected)


def test_lws_two_stages():
    embed = lambda qs: np.array([[1.0, 0.0]] * len(qs))  # all queries identical → cosine 1
    sched = lws_schedule(stage2_start=3, embed=embed)
    batch = _batch()
    # episode 0, no response_text and format_ok → +1; one concise query → 0;
    # stage 1 correct → 1 (total 2); stage 2 → 1 − 0.3 (total 1.7)
    # episodes 1 and 2: +1 and −1/(2·1) = −0.5 (two identical queries, Eq. 8); episode 1 is
    # correct: stage 1 +1, stage 2 1 − 0.6; episode 2 wrong: stage 1 −1 + 0.6, stage 2 −1
    assert sched(0)(batch) == pytest.approx([2.0, 1.5, 0.1])
    assert sched(3)(batch) == pytest.approx([1.7, 0.9, -0.5])


def test_graphrag_r1_three_phases():
    sched = graphrag_r1_schedule(phase3_start=10, sft_steps=5)
    assert [sched.stage_at(s) for s in (0, 5, 10)] == ["phase1_sft", "phase2", "phase3"]
    with pytest.raises(ValueError, match="supervised"):
        sched(2)
    # phase 2: 0.5 + PRA(N) with the default k = 1: N = 1 → 0.5, N = 2 → 1.0
    assert sched(5)(_batch()) == pytest.approx([1.0, 1.5, 1.5])
    # without SFT steps phase 2 starts at 0
    assert graphrag_r1_schedule(phase3_start=4).stage_at(0) == "phase2"


def test_from_config_builds_and_validates():
    sched = reward_schedule_from_config({"method": "routerag", "stage2_start": 2, "time_source": "cost"})
    assert sched.stage_at(1) == "stage1" and sched.stage_at(2) == "stage2"
    g = reward_schedule_from_config({"method": "graphrag_r1", "phase3_start": 7, "pra_decay": 1.0})
    # paper k = 1: 0.5 + 0.5·N
    assert g(0)(_batch()) == pytest.approx([1.0, 1.5, 1.5])
    assert reward_schedule_from_config({"method": "search_r1"})(0)(_batch()) == [1.0, 1.0, 0.0]
    assert reward_schedule_from_config({"method": "pathrouter"}).stage_at(50) == "main"
    with pytest.raises(ValueError, match="stage2_strat"):
        reward_schedule_from_config({"method": "routerag", "stage2_strat": 2})
    with pytest.raises(ValueError, match="phase3_start"):
        reward_schedule_from_config({"method": "graphrag_r1"})
    with pytest.raises(ValueError, match="unknown reward method"):
        reward_schedule_from_config({"method": "ppo"})
