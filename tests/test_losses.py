"""Clipped PG (PPO / DAPO clip-higher), aggregation, KL estimators, entropy, teacher KL."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raggym.algorithms import (
    aggregate_loss,
    clipped_policy_loss,
    entropy_bonus,
    entropy_from_logits,
    kl_estimate,
    kl_loss,
    kl_penalized_rewards,
    pathrouter_teacher_kl_loss,
    policy_gradient_loss,
    selective_teacher_kl_loss,
    teacher_kl_weight,
    teacher_topk,
    topk_forward_kl,
    topk_teacher_kl,
)


def _log(x):
    return torch.log(torch.tensor(x, dtype=torch.float64))


# --- clipped policy gradient ------------------------------------------------------------------


def test_clipped_loss_hand_computed_symmetric():
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = _log([[1.5, 0.5, 1.1]])  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    loss, stats = clipped_policy_loss(new, old, adv, mask, clip_low=0.2)
    # token 1: max(−1.5, −1.2) = −1.2 (clipped); token 2: max(−0.5, −0.8) = −0.5;
    # token 3: max(1.1, 1.1) = 1.1; token-mean = (−1.2 − 0.5 + 1.1)/3 = −0.2
    assert loss.item() == pytest.approx(-0.2)
    assert stats["clip_fraction"].item() == pytest.approx(1 / 3)


def test_clip_higher_and_negative_advantage_low_clip():
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = _log([[1.5, 0.5, 1.1]])
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, _ = clipped_policy_loss(new, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.28)
    # token 1 now clips at 1.28: −1.28; total (−1.28 − 0.5 + 1.1)/3
    assert loss.item() == pytest.approx(-0.68 / 3)
    # negative advantage, ratio 0.5: max(0.5, 0.8) = 0.8 — the lower bound binds
    loss_neg, _ = clipped_policy_loss(_log([[0.5]]), torch.zeros(1, 1, dtype=torch.float64),
                                      torch.tensor([[-1.0]], dtype=torch.float64), torch.ones(1, 1))
    assert loss_neg.item() == pytest.approx(0.8)


def test_dual_clip_caps_negative_advantage_tokens_hand_computed():
    old = torch.zeros(1, 4, dtype=torch.float64)
    new = _log([[5.0, 2.0, 5.0, 0.5]])  # ratios 5, 2, 5, 0.5
    adv = torch.tensor([[-1.0, -1.0, 2.0, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 4)
    plain, _ = clipped_policy_loss(new, old, adv, mask, clip_low=0.2)
    # without the dual clip: max(5, 1.2) = 5; max(2, 1.2) = 2; max(−10, −2.4) = −2.4;
    # max(1, 1.6) = 1.6 → mean (5 + 2 − 2.4 + 1.6)/4 = 1.55
    assert plain.item() == pytest.approx(1.55)
    loss, stats = clipped_policy_loss(new, old, adv, mask, clip_low=0.2, dual_clip=True, clip_ratio_c=3.0)
    # Â < 0 tokens capped at −Â·3: min(5, 3) = 3; min(2, 3) = 2; min(1.6, 6) = 1.6; the Â > 0
    # token keeps −2.4 → (3 + 2 − 2.4 + 1.6)/4 = 1.05; one of four tokens was capped
    assert loss.item() == pytest.approx(1.05)
    assert stats["clip_fraction_lower"].item() == pytest.approx(0.25)
    # the cap also blocks the gradient: ∂L/∂log π is 0 on the capped token, −Â·ρ/4 elsewhere
    new.requires_grad_(True)
    clipped_policy_loss(new, old, adv, mask, clip_low=0.2, dual_clip=True)[0].backward()
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 0.5, 0.0, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="greater than 1"):
        clipped_policy_loss(new, old, adv, mask, dual_clip=True, clip_ratio_c=1.0)


def test_sequence_advantages_broadcast_and_mask():
    old = torch.zeros(2, 2, dtype=torch.float64)
    new = torch.zeros(2, 2, dtype=torch.float64)  # ratio 1
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 0], [1, 1]])
    loss, _ = clipped_policy_loss(new, old, adv, mask)
    # tokens −2, −(−1), −(−1) → (−2 + 1 + 1)/3 = 0
    assert loss.item() == pytest.approx(0.0)
    loss_seq, _ = clipped_policy_loss(new, old, adv, mask, aggregation="seq-mean-token-mean")
    assert loss_seq.item() == pytest.approx((-2 + 1) / 2)


def test_aggregations_hand_computed():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert aggregate_loss(per_token, mask, "token-mean").item() == pytest.approx(10 / 4)
    # per-sequence means 2 and 4; the empty third sequence is left out
    assert aggregate_loss(per_token, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # per-sequence sums 6 and 4
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum", token_sum_norm=10).item() == pytest.approx(0.5)
    assert aggregate_loss(per_token, torch.zeros(3, 3)).item() == 0.0
    with pytest.raises(ValueError):
        aggregate_loss(per_token, mask, "mean")


_token_batch = st.integers(1, 4).flatmap(
    lambda b: st.integers(1, 6).flatmap(
        lambda t: st.tuples(
            st.lists(st.floats(-8, 0), min_size=b * t, max_size=b * t),
            st.lists(st.floats(-3, 3), min_size=b * t, max_size=b * t),
            st.lists(st.integers(0, 1), min_size=b * t, max_size=b * t),
            st.just((b, t)),
        )
    )
)


@settings(max_examples=100, deadline=None)
@given(_token_batch, st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
       st.floats(0.05, 0.4), st.floats(0.05, 0.4))
def test_property_clipped_equals_plain_pg_at_ratio_one(batch, aggregation, eps_low, eps_high):
    lp_values, adv_values, mask_values, shape = batch
    lp = torch.tensor(lp_values, dtype=torch.float64).reshape(shape).requires_grad_(True)
    adv = torch.tensor(adv_values, dtype=torch.float64).reshape(shape)
    mask = torch.tensor(mask_values, dtype=torch.float64).reshape(shape)
    old = lp.detach().clone()  # ratio = 1

    clipped, _ = clipped_policy_loss(lp, old, adv, mask, eps_low, eps_high, aggregation)
    (g_clipped,) = torch.autograd.grad(clipped, lp)
    plain = policy_gradient_loss(lp, old, adv, mask, aggregation)
    (g_plain,) = torch.autograd.grad(plain, lp)
    reinforce = aggregate_loss(-adv * lp, mask, aggregation)  # −Â log π
    (g_reinforce,) = torch.autograd.grad(reinforce, lp)

    torch.testing.assert_close(clipped, plain)
    torch.testing.assert_close(g_clipped, g_plain)
    torch.testing.assert_close(g_clipped, g_reinforce)


# --- KL ------------------------------------------------------------------------------------------


def test_kl_estimators_hand_computed():
    lp, ref = _log([0.5]), _log([0.25])  # log ratio = ln 2
    ln2 = math.log(2)
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(ln2)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * ln2**2)  # 0.2402
    # k3 = π_ref/π − 1 − ln(π_ref/π) = 0.5 − 1 + ln 2 = 0.1931
    assert kl_estimate(lp, ref, "low_var_kl").item() == pytest.approx(0.5 - 1 + ln2)
    assert kl_estimate(lp, ref, "k3").item() == kl_estimate(lp, ref, "low_var_kl").item()
    # abs: |ln 2| either way round
    assert kl_estimate(lp, ref, "abs").item() == pytest.approx(ln2)
    assert kl_estimate(ref, lp, "abs").item() == pytest.approx(ln2)
    assert kl_estimate(ref, lp, "k1").item() == pytest.approx(-ln2)
    # clamped at 10 when the reference is far more likely: e^20 − 1 − 20 → 10
    assert kl_estimate(_log([1e-12]), _log([0.9]), "k3").item() == 10.0
    with pytest.raises(ValueError):
        kl_estimate(lp, ref, "k4")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-30, 0), st.floats(-30, 0)), min_size=1, max_size=16),
       st.sampled_from([torch.float32, torch.float64]))
def test_property_k3_non_negative(pairs, dtype):
    lp = torch.tensor([p for p, _ in pairs], dtype=dtype)
    ref = torch.tensor([r for _, r in pairs], dtype=dtype)
    k3 = kl_estimate(lp, ref, "k3")
    assert bool((k3 >= 0).all())
    assert bool((kl_estimate(lp, ref, "k2") >= 0).all())


def test_kl_loss_and_reward_penalty():
    lp = torch.tensor([[0.0, 0.0, 0.0]])
    ref = torch.tensor([[-0.5, -0.25, -1.0]])  # k1 per token 0.5, 0.25, 1.0
    mask = torch.tensor([[1, 1, 0]])
    assert kl_loss(lp, ref, mask, "k1").item() == pytest.approx(0.375)  # (0.5 + 0.25)/2
    # r − β Σ_t KL_t = 1 − 0.1·0.75
    penalised = kl_penalized_rewards(torch.tensor([1.0]), lp, ref, mask, coef=0.1, kind="k1")
    assert penalised.item() == pytest.approx(0.925)
    same = kl_loss(ref, ref, torch.ones(1, 3))
    assert same.item() == 0.0


# --- entropy ---------------------------------------------------------------------------------------


def test_entropy_hand_computed():
    logits = torch.zeros(1, 2, 4)
    logits[0, 1] = torch.tensor([50.0, 0.0, 0.0, 0.0])  # almost one-hot
    h = entropy_from_logits(logits)
    assert h[0, 0].item() == pytest.approx(math.log(4))
    assert h[0, 1].item() == pytest.approx(0.0, abs=1e-6)
    assert entropy_bonus(logits, torch.tensor([[1, 0]])).item() == pytest.approx(math.log(4))


# --- PathRouter teacher KL -------------------------------------------------------------------------


def test_topk_teacher_kl_hand_computed():
    # teacher logits [ln 3, 0, −100]: top-2 = tokens 0, 1 → p̃_T = [0.75, 0.25]
    # student logits [0, 0, 5]: restricted to {0, 1} → p̃_S = [0.5, 0.5] (token 2's mass ignored)
    # KL = 0.75 ln 1.5 + 0.25 ln 0.5 = 0.130812
    teacher = torch.tensor([[[math.log(3), 0.0, -100.0]]])
    student = torch.tensor([[[0.0, 0.0, 5.0]]])
    kl = topk_teacher_kl(student, teacher, k=2)
    assert kl.shape == (1, 1)
    assert kl.item() == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), abs=1e-6)
    values, indices = teacher_topk(teacher, k=2)
    assert indices[0, 0].tolist() == [0, 1]
    torch.testing.assert_close(topk_forward_kl(student, values, indices), kl)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(2, 40), st.integers(1, 50), st.integers(0, 2**16))
def test_property_teacher_kl_zero_when_student_is_teacher(batch, seq, vocab, k, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(batch, seq, vocab, generator=gen)
    kl = topk_teacher_kl(logits.clone(), logits, k=k)
    torch.testing.assert_close(kl, torch.zeros(batch, seq), atol=1e-5, rtol=0)
    # and it is never negative (Gibbs) once the student moves away
    moved = logits + torch.randn(batch, seq, vocab, generator=gen)
    if min(k, vocab) > 1:
        assert bool((topk_teacher_kl(moved, logits, k=k) >= -1e-6).all())


def test_teacher_kl_weight_schedule():
    # λ = 0.1 · min(1, step/20)
    assert teacher_kl_weight(0) == 0.0
    assert teacher_kl_weight(10) == pytest.approx(0.05)
    assert teacher_kl_weight(20) == pytest.approx(0.1)
    assert teacher_kl_weight(400) == pytest.approx(0.1)


def test_selective_teacher_kl_hand_computed():
    per_position = torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 4.0], [9.0, 9.0, 9.0]])
    span_mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    low_evidence = torch.tensor([True, True, False])
    # row 0: mean over think/query positions (1 + 2)/2 = 1.5; row 1 has no such position;
    # row 2 has enough evidence. KL = 1.5; at step 10 the weight is 0.05 → 0.075
    loss, stats = selective_teacher_kl_loss(per_position, span_mask, low_evidence, teacher_kl_weight(10))
    assert loss.item() == pytest.approx(0.075)
    assert stats["teacher_kl"].item() == pytest.approx(1.5)
    assert stats["teacher_kl_trajectories"].item() == 1
    none, _ = selective_teacher_kl_loss(per_position, span_mask, torch.tensor([False] * 3), 0.1)
    assert none.item() == 0.0


def test_pathrouter_teacher_kl_gradient_reaches_student_only():
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(2, 3, 10, generator=gen, requires_grad=True)
    teacher = torch.randn(2, 3, 10, generator=gen, requires_grad=True)
    span_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    eo = torch.tensor([0.05, 0.5])  # only the first trajectory is evidence-poor
    loss, stats = pathrouter_teacher_kl_loss(student, teacher, span_mask, eo, step=40, top_k=4)
    loss.backward()
    assert stats["teacher_kl_trajectories"].item() == 1
    assert teacher.grad is None
    assert student.grad[0, :2].abs().sum() > 0  # think/query positions of the low-EO row
    assert student.grad[0, 2].abs().sum() == 0  # outside the span mask
    assert student.grad[1].abs().sum() == 0  # EO ≥ θ_P: no teacher guidance
