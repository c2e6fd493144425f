"""GRPO, Dr.GRPO, Step-GRPO, route-conditioned advantages, broadcasting, dynamic sampling."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raggym.algorithms import (
    PATHROUTER_ROUTE_WEIGHTS,
    Route,
    broadcast_to_tokens,
    dynamic_sampling_filter,
    group_index,
    grpo_advantages,
    route_conditioned_advantages,
    route_from_flags,
    step_grpo_advantages,
)

SQRT3_OVER_2 = math.sqrt(3) / 2  # 0.5 / sqrt(1/3)


def test_grpo_hand_computed_sample_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    groups = ["a", "a", "a", "a", "b", "b"]
    # group a: mean 0.5, squared deviations 4·0.25 = 1, sample var 1/3, std 0.57735
    # Â = ±0.5/0.57735 = ±0.8660; group b is uniform → 0
    adv = grpo_advantages(rewards, groups, eps=0.0)
    expected = torch.tensor([SQRT3_OVER_2, -SQRT3_OVER_2, -SQRT3_OVER_2, SQRT3_OVER_2, 0.0, 0.0])
    torch.testing.assert_close(adv, expected)


def test_grpo_population_std_and_dr_grpo():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    groups = [0, 0, 0, 0]
    # population var 0.25 → std 0.5 → Â = ±1
    torch.testing.assert_close(
        grpo_advantages(rewards, groups, eps=0.0, unbiased_std=False),
        torch.tensor([1.0, -1.0, -1.0, 1.0]),
    )
    # Dr.GRPO: no std division → ±0.5
    torch.testing.assert_close(
        grpo_advantages(rewards, groups, normalize_by_std=False), torch.tensor([0.5, -0.5, -0.5, 0.5])
    )


def test_grpo_uniform_and_singleton_groups_are_zero():
    # 0.1 three times: mean is not exactly 0.1 in floating point; the result must still be 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 7.0], dtype=torch.float64)
    adv = grpo_advantages(rewards, ["x", "x", "x", "solo"])
    assert torch.equal(adv, torch.zeros(4, dtype=torch.float64))


def test_grpo_singleton_group_verl_rule_hand_computed():
    rewards = torch.tensor([0.1, 0.1, 0.1, 7.0, 1.0, 0.0], dtype=torch.float64)
    groups = ["x", "x", "x", "solo", "p", "p"]
    # verl: the singleton has mean 0 and std 1 → 7 / (1 + ε); the uniform group stays 0; the
    # pair: ±0.5 / (std √0.5 + ε)
    eps = 1e-6
    adv = grpo_advantages(rewards, groups, eps=eps, singleton_group="verl")
    half = 0.5 / (math.sqrt(0.5) + eps)
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, 0.0, 7.0 / (1 + eps), half, -half], dtype=torch.float64))
    # Dr.GRPO (no std division): the singleton keeps its raw reward
    adv = grpo_advantages(rewards, groups, normalize_by_std=False, singleton_group="verl")
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, 0.0, 7.0, 0.5, -0.5], dtype=torch.float64))
    # raggym's default gives the singleton 0
    assert grpo_advantages(rewards, groups, singleton_group="zero")[3].item() == 0.0
    with pytest.raises(ValueError, match="singleton_group"):
        grpo_advantages(rewards, groups, singleton_group="mean")


def test_grpo_estimator_passes_the_singleton_rule():
    from raggym.algorithms.advantages import get_advantage_estimator

    out = get_advantage_estimator("grpo")(torch.tensor([3.0, 1.0, 2.0]), ["a", "b", "b"], singleton_group="verl", eps=0.0)
    # a: 3 / 1; b: mean 1.5, so 1 → −0.5 / √0.5 and 2 → +0.5 / √0.5
    torch.testing.assert_close(out.advantages, torch.tensor([3.0, -math.sqrt(0.5), math.sqrt(0.5)]))


def test_grpo_accepts_tensor_group_ids_and_keeps_dtype():
    rewards = torch.tensor([1.0, 0.0, 5.0, 3.0], dtype=torch.float64)
    adv = grpo_advantages(rewards, torch.tensor([7, 7, 2, 2]), eps=0.0)
    # each pair: mean-centred ±0.5 or ±1, sample std √0.5 or √2 → ±1/√2
    torch.testing.assert_close(adv, torch.tensor([1, -1, 1, -1], dtype=torch.float64) / math.sqrt(2))
    index, n = group_index(["b", "a", "b"])
    assert index.tolist() == [0, 1, 0] and n == 2
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(3), ["a", "b"])


def test_step_grpo_groups_per_step():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    prompts = ["p", "p", "p", "p"]
    steps = [0, 0, 1, 1]
    # step 0: [1, 0], mean 0.5, sample std √0.5 → ±0.7071; step 1 uniform → 0
    adv = step_grpo_advantages(rewards, prompts, steps, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0]))
    # one group per prompt would mix the steps and give something else
    assert not torch.allclose(adv, grpo_advantages(rewards, prompts, eps=0.0))


def test_route_flags_and_conditioned_advantages():
    correct = torch.tensor([True, True, False, False])
    supported = torch.tensor([True, False, True, False])
    assert route_from_flags(correct, supported).tolist() == [
        Route.CORRECT_SUPPORTED, Route.CORRECT_UNSUPPORTED,
        Route.INCORRECT_SUPPORTED, Route.INCORRECT_UNSUPPORTED,
    ]
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    adv, routes = route_conditioned_advantages(rewards, ["q"] * 4, correct, supported, eps=0.0)
    # Â = [+, +, −, −]·0.8660; weights 1.0, 0.5, 0.3, 1.0
    s = SQRT3_OVER_2
    torch.testing.assert_close(adv, torch.tensor([s, 0.5 * s, -0.3 * s, -s]))
    assert routes.tolist() == [0, 1, 2, 3]
    custom, _ = route_conditioned_advantages(rewards, ["q"] * 4, correct, supported, (2, 2, 2, 2), eps=0.0)
    torch.testing.assert_close(custom, 2 * torch.tensor([s, s, -s, -s]))
    with pytest.raises(ValueError):
        route_conditioned_advantages(rewards, ["q"] * 4, correct, supported, (1.0, 1.0))


def test_broadcast_to_tokens_applies_mask():
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    torch.testing.assert_close(broadcast_to_tokens(adv, mask), torch.tensor([[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]))
    with pytest.raises(ValueError):
        broadcast_to_tokens(adv, torch.ones(3, 2))


def test_dynamic_sampling_filter_drops_uniform_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    result = dynamic_sampling_filter(rewards, ["a", "a", "b", "b", "c", "c"])
    assert result.keep.tolist() == [False, False, True, True, False, False]
    assert (result.kept_groups, result.dropped_groups, result.dropped_samples) == (1, 2, 4)


# --- properties --------------------------------------------------------------------------------

_batches = st.lists(
    st.tuples(st.integers(0, 3), st.integers(-5, 5)), min_size=1, max_size=24
)


def _split(batch):
    groups = [g for g, _ in batch]
    rewards = torch.tensor([float(r) for _, r in batch], dtype=torch.float64)
    return rewards, groups


@settings(max_examples=150, deadline=None)
@given(_batches, st.booleans(), st.booleans())
def test_property_group_mean_is_zero(batch, by_std, unbiased):
    rewards, groups = _split(batch)
    adv = grpo_advantages(rewards, groups, normalize_by_std=by_std, unbiased_std=unbiased)
    for g in set(groups):
        members = [i for i, x in enumerate(groups) if x == g]
        assert abs(adv[members].sum().item()) < 1e-9 * max(1, len(members))


@settings(max_examples=150, deadline=None)
@given(_batches, st.floats(0.01, 100.0))
def test_property_positive_scaling_leaves_grpo_unchanged(batch, c):
    rewards, groups = _split(batch)
    base = grpo_advantages(rewards, groups, eps=1e-9)
    scaled = grpo_advantages(c * rewards, groups, eps=1e-9)
    torch.testing.assert_close(scaled, base, rtol=1e-5, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(_batches, st.data())
def test_property_unit_route_weights_reproduce_grpo(batch, data):
    rewards, groups = _split(batch)
    n = len(groups)
    correct = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    supported = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    adv, _ = route_conditioned_advantages(rewards, groups, correct, supported, (1.0, 1.0, 1.0, 1.0))
    assert torch.equal(adv, grpo_advantages(rewards, groups))


def test_default_route_weights_are_the_papers():
    assert PATHROUTER_ROUTE_WEIGHTS == (1.0, 0.5, 0.3, 1.0)


def test_science_layer_imports_no_runtime_layers():
    """raggym.rewards / raggym.algorithms must not pull in Ray, a model stack or upper layers."""
    import subprocess
    import sys

    code = (
        "import sys, raggym.rewards, raggym.algorithms\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'ray', 'actors', 'experiments', 'envs', 'transformers', 'vllm', 'deepspeed'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
