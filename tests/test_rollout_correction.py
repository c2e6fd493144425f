"""Rollout correction (issue #68): truncated and masked importance weights for the rollout
engine–learner gap, by hand, by property, and through the loss and the learner's denominator."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raggym.algorithms.losses import clipped_policy_loss
from raggym.algorithms.policy_loss import PolicyLossConfig
from raggym.algorithms.rollout_correction import (LEVELS, RolloutCorrectionConfig, mismatch_metrics,
                                                  rollout_correction)

LN = math.log
# Two sequences of 4 tokens; position 0 is the prompt. π_old / π_rollout per trained token:
#   row 0: 2, 0.5, 1      row 1: 2, 2, 1
OLD = torch.tensor([[0.0, LN(0.5), LN(0.2), LN(0.9)], [0.0, LN(0.5), LN(0.5), LN(0.9)]])
ROLLOUT = torch.tensor([[0.0, LN(0.25), LN(0.4), LN(0.9)], [0.0, LN(0.25), LN(0.25), LN(0.9)]])
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]])


def correct(level, kind, threshold, lower=None):
    return rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionConfig(level, kind, threshold, lower))


def test_token_truncation_by_hand():
    c = correct("token", "truncate", 1.5)
    torch.testing.assert_close(c.weights, torch.tensor([[1.0, 1.5, 0.5, 1.0], [1.0, 1.5, 1.5, 1.0]]))
    assert c.keep.tolist() == MASK.bool().tolist()  # truncation keeps every token
    assert c.metrics["rollout_is/changed_share"] == pytest.approx(3 / 6)  # the three ρ = 2 were capped
    assert c.metrics["rollout_is/weight_max"] == pytest.approx(1.5)
    assert c.metrics["rollout_is/weight_mean"] == pytest.approx((1.5 + 0.5 + 1 + 1.5 + 1.5 + 1) / 6)


def test_token_mask_by_hand_rejects_both_tails():
    c = correct("token", "mask", 1.5)  # keep 1/1.5 <= ρ <= 1.5
    assert c.keep.tolist() == [[False, False, False, True], [False, False, False, True]]
    assert c.metrics["rollout_is/changed_share"] == pytest.approx(4 / 6)
    assert c.metrics["rollout_is/weight_mean"] == pytest.approx(1.0)
    c = correct("token", "mask", 2.0, lower=0.6)  # ρ = 2 is inside [0.6, 2], ρ = 0.5 is not
    assert c.keep.tolist() == [[False, True, False, True], [False, True, True, True]]
    assert c.weights[1].tolist() == pytest.approx([1.0, 2.0, 2.0, 1.0])  # a kept token keeps its weight


def test_sequence_levels_by_hand():
    c = correct("sequence", "truncate", 3.0)  # Π ρ: row 0 is 1, row 1 is 4 → 3
    torch.testing.assert_close(c.weights[:, 1:], torch.tensor([[1.0] * 3, [3.0] * 3]))
    assert c.metrics["rollout_is/changed_share"] == pytest.approx(3 / 6)
    c = correct("geometric", "truncate", 3.0)  # (Π ρ)^(1/3): row 1 is 4^(1/3), under the cap
    torch.testing.assert_close(c.weights[:, 1:], torch.tensor([[1.0] * 3, [4 ** (1 / 3)] * 3]))
    assert c.metrics["rollout_is/changed_share"] == 0.0
    c = correct("sequence", "mask", 2.0)  # row 1's Π ρ = 4 > 2: the whole sequence leaves the loss
    assert c.keep.tolist() == [[False, True, True, True], [False, False, False, False]]


def test_the_diagnostics_by_hand():
    m = mismatch_metrics(OLD[:1], ROLLOUT[:1], MASK[:1])  # ρ = 2, 0.5, 1
    assert m["rollout_is/kl_k1"] == pytest.approx(0.0, abs=1e-7)  # (ln 2 + ln 0.5 + 0) / 3
    assert m["rollout_is/kl_k3"] == pytest.approx(((2 - 1 - LN(2)) + (0.5 - 1 - LN(0.5))) / 3)
    assert m["rollout_is/chi2_token"] == pytest.approx((4 + 0.25 + 1) / 3 - 1)
    assert m["rollout_is/chi2_seq"] == pytest.approx(0.0, abs=1e-6)  # geometric ρ of the row is 1
    assert m["rollout_is/ppl_ratio"] == pytest.approx(1.0)
    m = mismatch_metrics(OLD[1:], ROLLOUT[1:], MASK[1:])  # ρ = 2, 2, 1
    assert m["rollout_is/kl_k1"] == pytest.approx(-2 * LN(2) / 3)  # E[−log ρ]: negative on this one batch
    assert m["rollout_is/ppl_ratio"] == pytest.approx(math.exp(-2 * LN(2) / 3))  # π_old gives its tokens more mass
    assert m["rollout_is/chi2_seq"] == pytest.approx(4 ** (2 / 3) - 1)
    m = mismatch_metrics(OLD, ROLLOUT, MASK)  # the perplexity ratio per sequence, then averaged
    assert m["rollout_is/ppl_ratio"] == pytest.approx((1 + math.exp(-2 * LN(2) / 3)) / 2)  # pooled: e^(−2 ln 2 / 6)


logprob_rows = st.lists(st.floats(-6.0, 0.0, allow_nan=False), min_size=5, max_size=5)


@settings(max_examples=60, deadline=None)
@given(st.lists(logprob_rows, min_size=2, max_size=2), st.lists(logprob_rows, min_size=2, max_size=2),
       st.sampled_from(sorted(LEVELS)), st.sampled_from(["truncate", "mask"]), st.floats(1.01, 5.0))
def test_weights_stay_in_bounds_and_only_trained_tokens_change(old, rollout, level, kind, threshold):
    old, rollout = torch.tensor(old), torch.tensor(rollout)
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 1, 1, 1]])
    c = rollout_correction(old, rollout, mask, RolloutCorrectionConfig(level, kind, threshold))
    kept = c.keep & mask.bool()
    assert not bool((c.keep & ~mask.bool()).any())  # nothing outside the loss mask joins it
    assert bool((c.weights[kept] <= threshold * (1 + 1e-6)).all())
    if kind == "mask":
        assert bool((c.weights[kept] >= 1 / threshold * (1 - 1e-6)).all())
    else:
        assert c.keep.tolist() == mask.bool().tolist()
    assert bool((c.weights[~kept] == 1).all())
    m = mismatch_metrics(old, rollout, mask)
    ratio = torch.exp(old - rollout)[mask.bool() & (torch.arange(5) > 0)]
    assert m["rollout_is/kl_k3"] >= -1e-6  # ρ − 1 − log ρ ≥ 0
    assert m["rollout_is/chi2_token"] + 1 >= float(ratio.mean()) ** 2 * (1 - 1e-5)  # Jensen: E[ρ²] ≥ E[ρ]²


@settings(max_examples=30, deadline=None)
@given(st.lists(logprob_rows, min_size=2, max_size=2), st.sampled_from(sorted(LEVELS)))
def test_an_engine_equal_to_the_learner_changes_nothing(logprobs, level):
    same = torch.tensor(logprobs)
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    for kind in ("truncate", "mask"):
        c = rollout_correction(same, same.clone(), mask, RolloutCorrectionConfig(level, kind, 2.0))
        assert torch.equal(c.weights, torch.ones_like(same)) and c.keep.tolist() == mask.bool().tolist()
        assert c.metrics["rollout_is/changed_share"] == 0.0
    m = mismatch_metrics(same, same.clone(), mask)
    assert m["rollout_is/kl_k1"] == m["rollout_is/kl_k3"] == m["rollout_is/chi2_token"] == 0.0
    assert m["rollout_is/ppl_ratio"] == pytest.approx(1.0)


def test_weights_scale_each_tokens_clipped_loss():
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[0.0, -1.0, -2.0]])
    adv, mask = torch.tensor([1.0]), torch.tensor([[0.0, 1.0, 1.0]])
    weights = torch.tensor([[1.0, 2.0, 0.5]])
    loss, _ = clipped_policy_loss(logp, old, adv, mask, token_weights=weights)
    assert float(loss.detach()) == pytest.approx(-(2.0 + 0.5) / 2)  # mean of −Â·ρ·w at ρ = 1
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, -1.0, -0.25])  # −Â·w/2 per token


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="level must be one of"):
        RolloutCorrectionConfig("tokens")
    with pytest.raises(ValueError, match="kind must be"):
        RolloutCorrectionConfig("token", "clip")
    with pytest.raises(ValueError, match="lower < threshold"):
        RolloutCorrectionConfig("token", "mask", 2.0, lower=3.0)
    with pytest.raises(ValueError, match="unknown keys \\['thresh'\\]"):
        PolicyLossConfig(rollout_correction={"level": "token", "thresh": 2.0})
    assert PolicyLossConfig(rollout_correction={"level": "geometric", "kind": "mask"}).rollout_correction.bounds == (0.5, 2.0)
    assert not PolicyLossConfig().rollout_correction.enabled


def test_the_correction_needs_pi_old_from_the_learners_own_pass():
    from actors.learner import LearnerConfig

    correction = {"rollout_correction": {"level": "token"}}
    with pytest.raises(ValueError, match="set learner.old_logprobs: recompute"):
        LearnerConfig.from_dict({"loss": correction})  # default old_logprobs: rollout
    assert LearnerConfig.from_dict({"loss": correction, "old_logprobs": "recompute"}).loss.rollout_correction.enabled


# --- parity with public implementations -------------------------------------------------------
# The references' formulas, transcribed in our words over their [B, T] response masks (our
# position 0, the prompt, is outside them): ms-swift's GRPO trainer (_apply_rollout_importance_sampling,
# _compute_rollout_offpolicy_metrics) and verl's trainer/ppo/rollout_corr_helper.py
# (compute_offpolicy_metrics; its sequence level is the product). Both clamp log-ratios at ±20.

def _masked_mean(x, mask, dim=None):
    return (x * mask).sum() / mask.sum() if dim is None else (x * mask).sum(dim) / mask.sum(dim)


def reference_weights(log_ratio, mask, mode, c):
    ratio = torch.exp(log_ratio.clamp(-20, 20))
    if mode == "ms-swift token_truncate":
        return ratio.clamp(max=c)
    if mode == "ms-swift sequence_truncate":  # its sequence ratio: the geometric mean
        return torch.exp(_masked_mean(log_ratio, mask, -1)).clamp(max=c).unsqueeze(-1).expand_as(ratio)
    if mode == "verl sequence truncate":  # Π ρ
        return torch.exp((log_ratio * mask).sum(-1).clamp(-20, 20)).clamp(max=c).unsqueeze(-1).expand_as(ratio)
    raise ValueError(mode)


def reference_metrics(old, rollout, mask):
    log_ratio = (old - rollout) * mask
    per_seq_gap = _masked_mean(rollout, mask, -1) - _masked_mean(old, mask, -1)
    return {"rollout_is/kl_k1": float(_masked_mean(rollout - old, mask)),  # verl
            "rollout_is/kl_k3": float(_masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)),  # verl, ms-swift
            "rollout_is/ppl_ratio": float(torch.exp(per_seq_gap).mean()),  # verl, ms-swift
            "rollout_is/chi2_token": float(_masked_mean(torch.exp(log_ratio.clamp(-20, 20)) ** 2, mask) - 1),
            "rollout_is/chi2_seq": float((torch.exp(_masked_mean(log_ratio, mask, -1)) ** 2).mean() - 1)}  # ms-swift


@settings(max_examples=60, deadline=None)
@given(st.lists(logprob_rows, min_size=3, max_size=3), st.lists(logprob_rows, min_size=3, max_size=3),
       st.floats(1.05, 4.0))
def test_weights_and_diagnostics_match_the_public_references(old, rollout, threshold):
    old, rollout = torch.tensor(old), torch.tensor(rollout)
    loss_mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    response = loss_mask.float()  # position 0 is never trained, so the masks agree
    log_ratio = (old - rollout) * response
    ours = {level: rollout_correction(old, rollout, loss_mask, RolloutCorrectionConfig(level, "truncate", threshold))
            for level in ("token", "geometric", "sequence")}
    for level, mode in (("token", "ms-swift token_truncate"), ("geometric", "ms-swift sequence_truncate"),
                        ("sequence", "verl sequence truncate")):
        expected = reference_weights(log_ratio, response, mode, threshold)
        kept = loss_mask.bool()
        torch.testing.assert_close(ours[level].weights[kept], expected[kept], rtol=1e-5, atol=1e-6)
    m, ref = mismatch_metrics(old, rollout, loss_mask), reference_metrics(old, rollout, response)
    assert m == pytest.approx(ref, rel=1e-4, abs=1e-6)


def test_slime_657s_example_rejects_three_tokens_and_counts_two():
    # slime #657's worked case: log-ratios [0.1, −1.5, 0.8, −10, 0.3] under a mask of [0.5, 2.0];
    # tokens 1-3 are rejected, so the loss is a mean over the 2 kept tokens, not over 5
    log_ratio = torch.tensor([[0.0, 0.1, -1.5, 0.8, -10.0, 0.3]])  # our position 0 is the prompt
    mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    c = rollout_correction(log_ratio, torch.zeros_like(log_ratio), mask, RolloutCorrectionConfig("token", "mask", 2.0))
    assert c.keep.tolist() == [[False, True, False, False, False, True]]
    assert c.weights[0, [1, 5]].tolist() == pytest.approx([math.exp(0.1), math.exp(0.3)])
    logp = log_ratio.clone().requires_grad_(True)  # ρ = π/π_old = 1 at the first step
    loss, _ = clipped_policy_loss(logp, log_ratio, torch.tensor([1.0]), c.keep.float(), token_weights=c.weights)
    assert float(loss.detach()) == pytest.approx(-(math.exp(0.1) + math.exp(0.3)) / 2)
