"""RouteRAG: stage-1 EM and stage-2 EM + batch-centred efficiency, worked by hand."""

import numpy as np
import pytest

from raggym.rewards import (
    EpisodeOutcome,
    RouteRAGConfig,
    batch_centered_efficiency,
    routerag_batch_rewards,
    routerag_stage1_reward,
    routerag_stage2_rewards,
    scale_retrieval_times,
)


def _episode(answer, seconds=0.0, cost=0.0, prompt="q"):
    return EpisodeOutcome(
        answer=answer, gold_answers=("Paris",), retrieval_seconds=seconds, retrieval_cost=cost,
        prompt_id=prompt,
    )


def test_scale_uses_batch_p95_and_clips_at_half():
    # Sorted times [0, 10, 20, 20, 20]; p95 position 0.95·4 = 3.8 → 20 (linear interpolation).
    # t = min(0.5, 0.5·t/20) = [0, 0.25, 0.5, 0.5, 0.5]
    np.testing.assert_allclose(scale_retrieval_times([0, 10, 20, 20, 20]), [0, 0.25, 0.5, 0.5, 0.5])
    # 0..20: p95 position 0.95·20 = 19 → 19; t = 20 scales to 0.5·20/19 = 0.526, clipped to 0.5.
    scaled = scale_retrieval_times(list(range(21)))
    assert scaled[19] == pytest.approx(0.5)
    assert scaled[20] == 0.5
    assert scaled[10] == pytest.approx(0.5 * 10 / 19)


def test_scale_with_no_retrieval_time_is_zero():
    np.testing.assert_array_equal(scale_retrieval_times([0.0, 0.0]), [0.0, 0.0])
    with pytest.raises(ValueError):
        scale_retrieval_times([-1.0, 2.0])


def test_batch_centered_efficiency_hand_computed():
    # scaled [0, 0.25, 0.5, 0.5, 0.5]; t_avg = 1.75/5 = 0.35; R_eff = 0.35 − t
    np.testing.assert_allclose(
        batch_centered_efficiency([0, 10, 20, 20, 20]), [0.35, 0.10, -0.15, -0.15, -0.15]
    )
    # T = 2 halves every term.
    np.testing.assert_allclose(
        batch_centered_efficiency([0, 10, 20, 20, 20], temperature=2.0),
        [0.175, 0.05, -0.075, -0.075, -0.075],
    )


def test_stage1_is_exact_match():
    assert routerag_stage1_reward(_episode("paris")) == 1.0
    assert routerag_stage1_reward(_episode("Lyon")) == 0.0
    assert routerag_stage1_reward(_episode(None)) == 0.0


def test_stage2_hand_computed_over_the_whole_batch():
    # Two prompts (groups) in one batch; t_avg is over all five rollouts, not per group.
    batch = [
        _episode("Paris", seconds=0, prompt="a"),
        _episode("Paris", seconds=10, prompt="a"),
        _episode("Paris", seconds=20, prompt="b"),
        _episode("Lyon", seconds=20, prompt="b"),
        _episode(None, seconds=20, prompt="b"),
    ]
    # R_eff = [0.35, 0.10, −0.15, −0.15, −0.15]; R = 1 + R_eff if EM = 1 else 0
    np.testing.assert_allclose(routerag_stage2_rewards(batch), [1.35, 1.10, 0.85, 0.0, 0.0])
    # Scored without the other group, "a" gets other rewards: p95 of [0, 10] is 9.5, scaled
    # [0, 0.5], mean 0.25, R_eff [0.25, −0.25]. So the batch, not the group, sets the baseline.
    alone = routerag_stage2_rewards(batch[:2])
    np.testing.assert_allclose(alone, [1.25, 0.75])


def test_stage2_can_use_deterministic_cost():
    batch = [_episode("Paris", seconds=99, cost=0), _episode("Paris", seconds=0, cost=10)]
    # cost: p95 of [0, 10] = 9.5; scaled [0, 0.5]; mean 0.25; R = 1 + [0.25, −0.25]
    rewards = routerag_stage2_rewards(batch, RouteRAGConfig(time_source="cost"))
    np.testing.assert_allclose(rewards, [1.25, 0.75])
    # seconds would reverse the order
    np.testing.assert_allclose(routerag_stage2_rewards(batch), [0.75, 1.25])


def test_batch_rewards_dispatch_and_validation():
    batch = [_episode("Paris", seconds=1), _episode("Lyon", seconds=2)]
    assert routerag_batch_rewards(batch, 1) == [1.0, 0.0]
    assert routerag_batch_rewards(batch, 2) == routerag_stage2_rewards(batch)
    with pytest.raises(ValueError):
        routerag_batch_rewards(batch, 3)
    with pytest.raises(ValueError):
        RouteRAGConfig(time_source="tokens")
