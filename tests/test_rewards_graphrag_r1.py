"""GraphRAG-R1: format, PRA and CAF, worked by hand."""

import math

import pytest

from raggym.rewards import (
    EpisodeOutcome,
    GraphRAGR1Config,
    cost_aware_f1,
    graphrag_r1_batch_rewards,
    graphrag_r1_format_reward,
    graphrag_r1_phase2_reward,
    graphrag_r1_phase3_reward,
    progressive_retrieval_attenuation,
)


def test_format_reward():
    assert graphrag_r1_format_reward(True) == 0.5
    assert graphrag_r1_format_reward(False) == 0.0


def test_pra_default_is_the_papers_k_one():
    # k = 1 (implementation details): R_N = R0·N = 0.5·N
    assert GraphRAGR1Config().pra_decay == 1.0 and GraphRAGR1Config().pra_initial == 0.5
    assert progressive_retrieval_attenuation(0) == 0.0
    assert progressive_retrieval_attenuation(1) == pytest.approx(0.5)
    assert progressive_retrieval_attenuation(4) == pytest.approx(2.0)
    assert progressive_retrieval_attenuation(8) == pytest.approx(4.0)


def test_pra_geometric_k_half():
    # R_N = 0.5·(1 − 0.5^N)/(1 − 0.5) = 1 − 0.5^N
    assert progressive_retrieval_attenuation(1, k=0.5) == pytest.approx(0.5)
    assert progressive_retrieval_attenuation(2, k=0.5) == pytest.approx(0.75)
    assert progressive_retrieval_attenuation(3, k=0.5) == pytest.approx(0.875)
    # bounded by R0/(1 − k) = 1
    assert progressive_retrieval_attenuation(50, k=0.5) < 1.0


def test_pra_paper_k_one_is_linear_and_continuous():
    assert progressive_retrieval_attenuation(3, r0=0.5, k=1.0) == pytest.approx(1.5)
    assert progressive_retrieval_attenuation(0, k=1.0) == 0.0
    # the k → 1 limit of the geometric formula matches R0·N
    assert progressive_retrieval_attenuation(3, r0=0.5, k=1 - 1e-9) == pytest.approx(1.5, rel=1e-6)
    with pytest.raises(ValueError):
        progressive_retrieval_attenuation(-1)


def test_caf_hand_computed():
    assert cost_aware_f1(1.0, 0) == pytest.approx(2.0)  # 1·2·e^0
    assert cost_aware_f1(0.5, 2) == pytest.approx(0.5 * 2 * math.exp(-0.2))  # 0.81873
    assert cost_aware_f1(0.0, 3) == 0.0


def _episode(answer, n, format_ok=True):
    return EpisodeOutcome(
        answer=answer, gold_answers=("Paris",), queries=tuple(f"q{i}" for i in range(n)),
        format_ok=format_ok,
    )


def test_phase_rewards():
    # phase 2 at the default k = 1: 0.5 + PRA(2) = 0.5 + 0.5·2
    assert graphrag_r1_phase2_reward(_episode("Lyon", 2)) == pytest.approx(1.5)
    # at k = 0.5: 0.5 + 0.75
    assert graphrag_r1_phase2_reward(_episode("Lyon", 2), GraphRAGR1Config(pra_decay=0.5)) == pytest.approx(1.25)
    # phase 3, broken format, F1("Paris France", "Paris") = 2/3: 0 + (2/3)·2·e^(−0.1·2)
    assert graphrag_r1_phase3_reward(_episode("Paris France", 2, format_ok=False)) == pytest.approx(
        (2 / 3) * 2 * math.exp(-0.2)
    )
    # broken format at k = 1 with 3 retrievals: 0 + 0.5·3
    assert graphrag_r1_phase2_reward(_episode("x", 3, format_ok=False)) == pytest.approx(1.5)


def test_batch_dispatch():
    batch = [_episode("Paris", 0), _episode("Lyon", 1)]
    assert graphrag_r1_batch_rewards([*batch, _episode("Lyon", 3)], 2) == pytest.approx([0.5, 1.0, 2.0])
    assert graphrag_r1_batch_rewards(batch, 3) == pytest.approx([2.5, 0.5])
    with pytest.raises(ValueError, match="SFT"):
        graphrag_r1_batch_rewards(batch, 1)
