"""Parity with verl's ``verl/trainer/ppo/core_algos.py`` on random inputs, to 1e-6.

The references below are written here from the formulas verl implements (read in verl's source,
not copied): group-relative advantages with verl's rule for groups of one, the clipped surrogate
with the dual clip for negative advantages, the loss aggregations and the KL estimators. Each is
a deliberately plain per-element or per-group loop, so it shares no code path with raggym's
vectorised functions. ``docs/_fidelity_verl.md`` lists the mapping and the known differences.
"""

import math

import pytest
import torch

from raggym.algorithms import aggregate_loss, clipped_policy_loss, grpo_advantages, kl_estimate

TOLERANCE = 1e-6
SEEDS = range(5)


# --- references, from the maths ------------------------------------------------------------------


def reference_grpo(scores: list[float], groups: list[int], eps: float, by_std: bool) -> list[float]:
    """verl's GRPO: per group mean and sample std; a group of one has mean 0 and std 1."""
    members: dict[int, list[float]] = {}
    for score, group in zip(scores, groups):
        members.setdefault(group, []).append(score)
    stats = {}
    for group, values in members.items():
        n = len(values)
        if n == 1:
            stats[group] = (0.0, 1.0)
        else:
            mean = sum(values) / n
            stats[group] = (mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)))
    out = []
    for score, group in zip(scores, groups):
        mean, std = stats[group]
        out.append((score - mean) / (std + eps) if by_std else score - mean)
    return out


def reference_token_loss(ratio: float, advantage: float, low: float, high: float, c: float) -> float:
    """One token of verl's clipped loss with the dual clip (always on in verl)."""
    clipped_ratio = min(max(ratio, 1.0 - low), 1.0 + high)
    loss = max(-advantage * ratio, -advantage * clipped_ratio)
    if advantage < 0:
        loss = min(loss, -advantage * c)
    return loss


def reference_aggregate(losses: list[list[float]], mask: list[list[float]], mode: str) -> float:
    """verl's aggregation over one batch (a single data-parallel rank)."""
    if mode == "token-mean":
        return sum(l * m for row, mrow in zip(losses, mask) for l, m in zip(row, mrow)) / sum(map(sum, mask))
    per_seq = []
    for row, mrow in zip(losses, mask):
        count = sum(mrow)
        if count == 0:
            continue  # fully masked sequences are left out of the mean
        total = sum(l * m for l, m in zip(row, mrow))
        per_seq.append(total / count if mode == "seq-mean-token-mean" else total)
    return sum(per_seq) / len(per_seq)


def reference_kl(logprob: float, ref_logprob: float, kind: str) -> float:
    diff = logprob - ref_logprob
    if kind == "k1":
        return diff
    if kind == "abs":
        return abs(diff)
    if kind == "k2":
        return 0.5 * diff * diff
    x = min(max(-diff, -20.0), 20.0)  # log(π_ref/π), clamped as verl does
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


# --- random inputs -------------------------------------------------------------------------------


def _batch(seed: int, batch: int = 12, seq: int = 9):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(batch, seq, generator=g, dtype=torch.float64) * 3.0
    old = logp + torch.randn(batch, seq, generator=g, dtype=torch.float64) * 0.6  # ratios far from 1
    ref = logp + torch.randn(batch, seq, generator=g, dtype=torch.float64) * 2.0
    adv = torch.randn(batch, seq, generator=g, dtype=torch.float64) * 2.0
    mask = (torch.rand(batch, seq, generator=g) > 0.3).double()
    mask[0] = 0.0  # one fully masked sequence
    old[2, 0], adv[2, 0], mask[2, 0] = logp[2, 0] - 2.0, -1.0, 1.0  # ratio e² > c with Â < 0: the dual clip binds
    return logp, old, ref, adv, mask


MAX_ERRORS: dict[str, float] = {}


def _record(name: str, error: float) -> None:
    MAX_ERRORS[name] = max(MAX_ERRORS.get(name, 0.0), error)
    assert error <= TOLERANCE, f"{name}: max abs error {error:.3g} > {TOLERANCE}"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("by_std", [True, False])
def test_grpo_matches_verl_with_the_verl_singleton_rule(seed, by_std):
    g = torch.Generator().manual_seed(seed)
    groups = [0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 4, 5, 5, 6]  # groups of one (1, 4), of two, three, four
    scores = (torch.randn(len(groups), generator=g, dtype=torch.float64) * 3).tolist()
    scores[7] = scores[8] = scores[9] = scores[6]  # an equal-reward group: 0 in both
    expected = torch.tensor(reference_grpo(scores, groups, 1e-6, by_std), dtype=torch.float64)
    got = grpo_advantages(torch.tensor(scores, dtype=torch.float64), groups, eps=1e-6,
                          normalize_by_std=by_std, singleton_group="verl")
    _record("grpo", float((got - expected).abs().max()))
    # the default rule differs from verl only on the groups of one
    default = grpo_advantages(torch.tensor(scores, dtype=torch.float64), groups, eps=1e-6, normalize_by_std=by_std)
    singles = [i for i, k in enumerate(groups) if groups.count(k) == 1]
    assert all(default[i].item() == 0.0 for i in singles)
    others = [i for i in range(len(groups)) if i not in singles]
    torch.testing.assert_close(default[others], expected[others], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_dual_clip_loss_matches_verl(seed, aggregation):
    logp, old, _, adv, mask = _batch(seed)
    low, high, c = 0.2, 0.28, 3.0
    ratios = torch.exp(logp - old).tolist()
    per_token = [[reference_token_loss(r, a, low, high, c) for r, a in zip(rr, ar)] for rr, ar in zip(ratios, adv.tolist())]
    expected = reference_aggregate(per_token, mask.tolist(), aggregation)
    got, _ = clipped_policy_loss(logp, old, adv, mask, clip_low=low, clip_high=high, aggregation=aggregation,
                                 dual_clip=True, clip_ratio_c=c)
    _record(f"clipped_loss/{aggregation}", abs(got.item() - expected))
    # the inputs do reach the cap: without the dual clip the loss is different
    plain, _ = clipped_policy_loss(logp, old, adv, mask, clip_low=low, clip_high=high, aggregation=aggregation)
    assert abs(plain.item() - expected) > 1e-3


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregation_matches_verl(seed, aggregation):
    logp, _, _, adv, mask = _batch(seed)
    expected = reference_aggregate(adv.tolist(), mask.tolist(), aggregation)
    _record(f"aggregate/{aggregation}", abs(aggregate_loss(adv, mask, aggregation).item() - expected))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
def test_kl_estimators_match_verl(seed, kind):
    logp, _, ref, _, _ = _batch(seed)
    ref = ref.clone()
    ref[1, :3] = logp[1, :3] + 25.0  # beyond the ±20 clamp and the cap at 10
    expected = torch.tensor([[reference_kl(a, b, kind) for a, b in zip(ra, rb)] for ra, rb in zip(logp.tolist(), ref.tolist())],
                            dtype=torch.float64)
    _record(f"kl/{kind}", float((kl_estimate(logp, ref, kind) - expected).abs().max()))


def test_report_max_errors():
    """Runs last in this file: the largest error seen per function (``pytest -s`` prints it)."""
    if not MAX_ERRORS:
        pytest.skip("run with the parity tests above")
    print("verl parity, max abs error:", {k: f"{v:.2e}" for k, v in sorted(MAX_ERRORS.items())})
    assert max(MAX_ERRORS.values()) <= TOLERANCE
